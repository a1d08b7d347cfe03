#include "router/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::Status Admission::Enter(absl::Time deadline, const std::function<bool()>& cancelled) {
  absl::MutexLock l(&mu_);
  if (streams_ < max_streams_ && waiting_.empty()) {
    ++streams_;
    return absl::OkStatus();
  }
  if (static_cast<int>(waiting_.size()) >= max_queued_) {
    return absl::ResourceExhaustedError(absl::StrCat("the server is full (", streams_,
                                                     " requests in progress, ", waiting_.size(),
                                                     " waiting); retry after a short wait"));
  }
  const uint64_t ticket = next_ticket_++;
  waiting_.push_back(ticket);
  auto my_turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return streams_ < max_streams_ && waiting_.front() == ticket;
  };
  for (;;) {
    // Wake up now and then to notice a client that went away.
    if (mu_.AwaitWithDeadline(absl::Condition(&my_turn),
                              std::min(deadline, absl::Now() + absl::Milliseconds(50)))) {
      waiting_.pop_front();
      ++streams_;
      return absl::OkStatus();
    }
    const bool gone = cancelled && cancelled();
    if (gone || absl::Now() >= deadline) {
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), ticket));
      return gone ? absl::CancelledError("the client cancelled while the request was queued")
                  : absl::DeadlineExceededError(
                        "the deadline passed while the request waited for a free slot");
    }
  }
}

void Admission::Leave() {
  absl::MutexLock l(&mu_);
  --streams_;
}

int Admission::streams() const {
  absl::MutexLock l(&mu_);
  return streams_;
}

int Admission::queued() const {
  absl::MutexLock l(&mu_);
  return static_cast<int>(waiting_.size());
}

}  // namespace infinigen
