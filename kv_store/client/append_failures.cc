#include "kv_store/client/append_failures.h"

#include "absl/strings/str_cat.h"

namespace infinigen {

void AppendFailures::Record(StoreSequenceId seq, int layer, const absl::Status& status) {
  if (status.ok()) return;
  absl::MutexLock lock(&mu_);
  failed_.try_emplace(
      seq, absl::Status(status.code(), absl::StrCat("layer ", layer, ": ", status.message())));
}

void AppendFailures::Forget(StoreSequenceId seq) {
  absl::MutexLock lock(&mu_);
  failed_.erase(seq);
}

absl::Status AppendFailures::Explain(const absl::Status& gather,
                                     std::span<const ClientGatherItem> items) const {
  if (gather.ok()) return gather;
  absl::MutexLock lock(&mu_);
  for (const ClientGatherItem& item : items) {
    auto it = failed_.find(item.seq);
    if (it == failed_.end()) continue;
    const absl::StatusCode code =
        gather.code() == absl::StatusCode::kInvalidArgument ? it->second.code() : gather.code();
    return absl::Status(
        code, absl::StrCat(gather.message(), " (an append to sequence ", item.seq,
                           " failed before it: ", absl::StatusCodeToString(it->second.code()), ", ",
                           it->second.message(), ")"));
  }
  return gather;
}

}  // namespace infinigen
