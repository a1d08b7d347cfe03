// StallWatchdog: finds relayed streams whose worker stopped sending (a frozen process, a stuck
// engine, a link that drops packets without closing) and cancels their worker call, so that the
// relay moves them to another worker instead of waiting for as long as the worker stays frozen.
//
// A stream is stalled when nothing arrived from its worker for
//   - `when_down` while the pool's health checks find the worker down (a frozen or unreachable
//     process: its health probes time out within about a second; PooledWorker::State::kDown, not
//     kFailed, the failure of another call to it, which says nothing of this stream), or
//   - max(`timeout`, `gap_factor` x the stream's mean time between messages so far), once it has
//     received a message (an engine that is stuck while its process still answers health checks).
// Before its first message a stream may be in a long prefill: only the health rule applies.
//
// One thread checks every registered stream each `tick`.
#pragma once

#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "router/worker_pool.h"

namespace infinigen {

struct StallRules {
  absl::Duration when_down = absl::Seconds(1);
  absl::Duration timeout = absl::Seconds(30);
  double gap_factor = 20;
  absl::Status Validate() const;
};

// Whether a stream idle for `idle` is stalled (the rules above); `messages` received so far over
// `active` (its first message to now).
bool IsStalled(const StallRules& rules, absl::Duration idle, bool worker_down, int64_t messages,
               absl::Duration active);

class StallWatchdog {
 public:
  explicit StallWatchdog(const StallRules& rules, absl::Duration tick = absl::Milliseconds(100));
  ~StallWatchdog();

  // One worker call of a relayed stream, watched while it lives (construct it after the call's
  // context, destroy it before).
  class Watch {
   public:
    Watch(StallWatchdog& dog, grpc::ClientContext& call, const PooledWorker& worker);
    ~Watch();
    void Progress();  // a message arrived
    // Whether the watchdog cancelled the call because it stalled.
    bool stalled() const;

   private:
    friend class StallWatchdog;
    StallWatchdog& dog_;
    grpc::ClientContext& call_;
    const PooledWorker& worker_;
    absl::Time last_ ABSL_GUARDED_BY(dog_.mu_);
    absl::Time first_ ABSL_GUARDED_BY(dog_.mu_) = absl::InfinitePast();
    int64_t messages_ ABSL_GUARDED_BY(dog_.mu_) = 0;
    bool stalled_ ABSL_GUARDED_BY(dog_.mu_) = false;
  };

 private:
  void Loop();

  const StallRules rules_;
  const absl::Duration tick_;
  mutable absl::Mutex mu_;
  absl::flat_hash_set<Watch*> watches_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace infinigen
