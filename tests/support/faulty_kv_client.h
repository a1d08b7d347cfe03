// FaultyKvClient: a KvStoreClient decorator for tests that passes every call to a real client
// and injects the faults a test names, per store sequence: failed opens, attaches, closes,
// appends and gathers, and gathers that never finish (their Wait reaches its deadline). A failed
// append is dropped and reported the way a write-behind append's failure is: by Flush, and by
// the gathers of its sequence, which name it (AppendFailures). A gather fails as a whole when
// any of its items touches a faulty sequence, as the store's own Gather does. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv_store/client/append_failures.h"
#include "kv_store/client/kv_store_client.h"

namespace infinigen::testing {

class FaultyKvClient final : public KvStoreClient {
 public:
  explicit FaultyKvClient(KvStoreClient& inner) : inner_(inner) {}

  enum class Op { kOpen, kAttach, kClose, kRelease, kAppend, kGather };
  // From now on, `op` calls that touch store sequence `seq` fail with `status`.
  void Fail(Op op, StoreSequenceId seq, absl::Status status);
  // From now on, gathers that touch `seq` get no answer for `stall` (a Wait with an earlier
  // deadline reaches it), then fail DEADLINE_EXCEEDED, as a transport's own deadline would.
  void Stall(StoreSequenceId seq, absl::Duration stall = absl::Seconds(2));
  void Heal();               // no more faults from now on
  int64_t injected() const;  // calls that failed or stalled by a fault so far

  std::string transport() const override { return inner_.transport(); }
  absl::Status Open(StoreSequenceId seq, const SequenceSpec& spec) override;
  absl::Status Close(StoreSequenceId seq) override;
  absl::Status Release(StoreSequenceId seq) override;
  absl::StatusOr<int64_t> Attach(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                                 int64_t max_length) override;
  absl::StatusOr<int64_t> Fork(StoreSequenceId from, StoreSequenceId to, const SequenceSpec& spec,
                               int64_t length) override;
  using KvStoreClient::AppendAsync;
  void AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                   std::span<const uint8_t> k, std::span<const uint8_t> v,
                   std::span<const int32_t> slots) override;
  absl::Status Flush(absl::Time deadline) override;
  std::shared_ptr<GatherTicket> GatherAsync(std::span<const ClientGatherItem> items) override;
  bool reads_in_place() const override { return inner_.reads_in_place(); }
  Span mapped_memory() const override { return inner_.mapped_memory(); }
  absl::StatusOr<KvStoreStats> Stats() override { return inner_.Stats(); }

 private:
  // The fault for `op` on `seq`, counted as injected; OK when none.
  absl::Status Fault(Op op, StoreSequenceId seq);

  KvStoreClient& inner_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::pair<int, StoreSequenceId>, absl::Status> faults_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StoreSequenceId, absl::Duration> stalled_ ABSL_GUARDED_BY(mu_);
  int64_t injected_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status append_error_ ABSL_GUARDED_BY(mu_);  // the first dropped append since Flush
  AppendFailures append_failures_;
};

}  // namespace infinigen::testing
