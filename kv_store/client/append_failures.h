// The first failed append of each sequence, kept by a client whose appends are write-behind, so
// that a later gather that fails for want of those rows says why: the store's answer alone ("token
// index 40 is outside [0, 40)") would blame the caller for what a full store or an ended lease
// did. Thread-safe.
#pragma once

#include <span>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen {

class AppendFailures {
 public:
  // Keeps the first failure of `seq` until Forget(seq) (the sequence is closed or opened anew).
  void Record(StoreSequenceId seq, int layer, const absl::Status& status);
  void Forget(StoreSequenceId seq);
  // `gather` as it is when it succeeded or none of its sequences lost an append; else with the
  // append's failure named, and the append's code in place of INVALID_ARGUMENT.
  absl::Status Explain(const absl::Status& gather, std::span<const ClientGatherItem> items) const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<StoreSequenceId, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace infinigen
