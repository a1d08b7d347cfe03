#include "router/stall_watchdog.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::Status StallRules::Validate() const {
  if (when_down <= absl::ZeroDuration() || timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stall timeouts must be positive, got ", absl::FormatDuration(when_down),
                     " (worker down) and ", absl::FormatDuration(timeout)));
  }
  if (!(gap_factor >= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the stall gap factor must be >= 1, got ", gap_factor));
  }
  return absl::OkStatus();
}

bool IsStalled(const StallRules& rules, absl::Duration idle, bool worker_down, int64_t messages,
               absl::Duration active) {
  if (worker_down && idle >= rules.when_down) return true;
  if (messages == 0) return false;  // a prefill may take long; a live worker answers health
  // Mean gap between messages: the first message ends the prefill, so n messages span n - 1.
  const absl::Duration mean = messages > 1 ? active / (messages - 1) : absl::ZeroDuration();
  return idle >= std::max(rules.timeout, mean * rules.gap_factor);
}

StallWatchdog::StallWatchdog(const StallRules& rules, absl::Duration tick)
    : rules_(rules), tick_(tick) {
  thread_ = std::thread([this] { Loop(); });
}

StallWatchdog::~StallWatchdog() {
  stop_.Notify();
  thread_.join();
}

void StallWatchdog::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(tick_)) {
    const absl::Time now = absl::Now();
    absl::MutexLock l(&mu_);
    for (Watch* w : watches_) {
      if (w->stalled_) continue;
      const bool down = w->worker_.state() == PooledWorker::State::kDown;
      const absl::Duration active = w->messages_ > 0 ? w->last_ - w->first_ : absl::ZeroDuration();
      if (IsStalled(rules_, now - w->last_, down, w->messages_, active)) {
        w->stalled_ = true;
        w->call_.TryCancel();  // under mu_: the call outlives its Watch
      }
    }
  }
}

StallWatchdog::Watch::Watch(StallWatchdog& dog, grpc::ClientContext& call,
                            const PooledWorker& worker)
    : dog_(dog), call_(call), worker_(worker) {
  absl::MutexLock l(&dog_.mu_);
  last_ = absl::Now();
  dog_.watches_.insert(this);
}

StallWatchdog::Watch::~Watch() {
  absl::MutexLock l(&dog_.mu_);
  dog_.watches_.erase(this);
}

void StallWatchdog::Watch::Progress() {
  const absl::Time now = absl::Now();
  absl::MutexLock l(&dog_.mu_);
  if (messages_++ == 0) first_ = now;
  last_ = now;
}

bool StallWatchdog::Watch::stalled() const {
  absl::MutexLock l(&dog_.mu_);
  return stalled_;
}

}  // namespace infinigen
