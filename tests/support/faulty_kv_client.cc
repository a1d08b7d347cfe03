#include "tests/support/faulty_kv_client.h"

#include <algorithm>
#include <utility>

#include "absl/synchronization/notification.h"

namespace infinigen::testing {
namespace {

// A gather the store does not answer for `stall`; then it fails as the transport's own
// deadline would fail it (every Wait with an earlier deadline lasts until that deadline).
class StalledTicket final : public GatherTicket {
 public:
  explicit StalledTicket(absl::Duration stall) : end_(absl::Now() + stall) {}
  absl::Status Wait(absl::Time deadline) override {
    never_.WaitForNotificationWithDeadline(std::min(deadline, end_));
    return absl::DeadlineExceededError("the KV store did not answer the gather in time");
  }
  bool Done() override { return absl::Now() >= end_; }

 private:
  const absl::Time end_;
  absl::Notification never_;
};

// The real gather, its error explained by the appends this decorator dropped.
class ExplainedTicket final : public GatherTicket {
 public:
  ExplainedTicket(std::shared_ptr<GatherTicket> inner, const AppendFailures& failures,
                  std::vector<ClientGatherItem> items)
      : inner_(std::move(inner)), failures_(failures), items_(std::move(items)) {}
  absl::Status Wait(absl::Time deadline) override {
    return failures_.Explain(inner_->Wait(deadline), items_);
  }
  bool Done() override { return inner_->Done(); }

 private:
  std::shared_ptr<GatherTicket> inner_;
  const AppendFailures& failures_;
  std::vector<ClientGatherItem> items_;
};

}  // namespace

void FaultyKvClient::Fail(Op op, StoreSequenceId seq, absl::Status status) {
  absl::MutexLock lock(&mu_);
  faults_[{static_cast<int>(op), seq}] = std::move(status);
}

void FaultyKvClient::Stall(StoreSequenceId seq, absl::Duration stall) {
  absl::MutexLock lock(&mu_);
  stalled_[seq] = stall;
}

void FaultyKvClient::Heal() {
  absl::MutexLock lock(&mu_);
  faults_.clear();
  stalled_.clear();
}

int64_t FaultyKvClient::injected() const {
  absl::MutexLock lock(&mu_);
  return injected_;
}

absl::Status FaultyKvClient::Fault(Op op, StoreSequenceId seq) {
  absl::MutexLock lock(&mu_);
  auto it = faults_.find({static_cast<int>(op), seq});
  if (it == faults_.end()) return absl::OkStatus();
  ++injected_;
  return it->second;
}

absl::Status FaultyKvClient::Open(StoreSequenceId seq, const SequenceSpec& spec) {
  if (absl::Status st = Fault(Op::kOpen, seq); !st.ok()) return st;
  absl::Status st = inner_.Open(seq, spec);
  if (st.ok()) append_failures_.Forget(seq);
  return st;
}

absl::Status FaultyKvClient::Close(StoreSequenceId seq) {
  if (absl::Status st = Fault(Op::kClose, seq); !st.ok()) return st;
  append_failures_.Forget(seq);
  return inner_.Close(seq);
}

absl::Status FaultyKvClient::Release(StoreSequenceId seq) {
  if (absl::Status st = Fault(Op::kRelease, seq); !st.ok()) return st;
  append_failures_.Forget(seq);
  return inner_.Release(seq);
}

absl::StatusOr<int64_t> FaultyKvClient::Attach(StoreSequenceId from, StoreSequenceId to,
                                               const SequenceSpec& spec, int64_t max_length) {
  if (absl::Status st = Fault(Op::kAttach, from); !st.ok()) return st;  // both ids are touched
  if (absl::Status st = Fault(Op::kAttach, to); !st.ok()) return st;
  absl::StatusOr<int64_t> kept = inner_.Attach(from, to, spec, max_length);
  if (kept.ok()) append_failures_.Forget(to);
  return kept;
}

absl::StatusOr<int64_t> FaultyKvClient::Fork(StoreSequenceId from, StoreSequenceId to,
                                             const SequenceSpec& spec, int64_t length) {
  if (absl::Status st = Fault(Op::kAttach, to); !st.ok()) return st;  // as an attach does
  absl::StatusOr<int64_t> copied = inner_.Fork(from, to, spec, length);
  if (copied.ok()) append_failures_.Forget(to);
  return copied;
}

void FaultyKvClient::AppendAsync(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                                 std::span<const uint8_t> k, std::span<const uint8_t> v,
                                 std::span<const int32_t> slots) {
  if (absl::Status st = Fault(Op::kAppend, seq); !st.ok()) {
    append_failures_.Record(seq, layer, st);
    absl::MutexLock lock(&mu_);
    if (append_error_.ok()) append_error_ = st;
    return;
  }
  inner_.AppendAsync(seq, layer, start, n, k, v, slots);
}

absl::Status FaultyKvClient::Flush(absl::Time deadline) {
  absl::Status inner = inner_.Flush(deadline);
  absl::MutexLock lock(&mu_);
  absl::Status mine = std::exchange(append_error_, absl::OkStatus());
  return mine.ok() ? inner : mine;
}

std::shared_ptr<GatherTicket> FaultyKvClient::GatherAsync(std::span<const ClientGatherItem> items) {
  for (const ClientGatherItem& it : items) {
    if (absl::Status st = Fault(Op::kGather, it.seq); !st.ok()) {
      return std::make_shared<DoneTicket>(st);
    }
    absl::MutexLock lock(&mu_);
    if (auto stalled = stalled_.find(it.seq); stalled != stalled_.end()) {
      ++injected_;
      return std::make_shared<StalledTicket>(stalled->second);
    }
  }
  return std::make_shared<ExplainedTicket>(
      inner_.GatherAsync(items), append_failures_,
      std::vector<ClientGatherItem>(items.begin(), items.end()));  // for the explanation
}

}  // namespace infinigen::testing
