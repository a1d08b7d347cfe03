// The router's bound on work in flight: at most `max_streams` requests are being served, at
// most `max_queued` more wait (in arrival order) for one of them to finish; anything beyond is
// refused at once, so a burst cannot exhaust the router's threads or memory.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace infinigen {

class Admission {
 public:
  Admission(int max_streams, int max_queued) : max_streams_(max_streams), max_queued_(max_queued) {}

  // A slot, or RESOURCE_EXHAUSTED (queue full), DEADLINE_EXCEEDED (waited past `deadline`),
  // CANCELLED (`cancelled` turned true while waiting; polled).
  absl::Status Enter(absl::Time deadline, const std::function<bool()>& cancelled);
  void Leave();

  int streams() const;
  int queued() const;

 private:
  const int max_streams_;
  const int max_queued_;
  mutable absl::Mutex mu_;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> waiting_ ABSL_GUARDED_BY(mu_);  // tickets in arrival order
};

// RAII slot.
class AdmissionSlot {
 public:
  explicit AdmissionSlot(Admission* a) : a_(a) {}
  ~AdmissionSlot() {
    if (a_ != nullptr) a_->Leave();
  }
  AdmissionSlot(const AdmissionSlot&) = delete;
  AdmissionSlot& operator=(const AdmissionSlot&) = delete;

 private:
  Admission* a_;
};

}  // namespace infinigen
