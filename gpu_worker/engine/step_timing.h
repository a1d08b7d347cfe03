// Host wall time of a scope, added to a DecodeStep profile field: shared by decode_step.cc and
// decode_step_attend.cc.
#pragma once

#include <chrono>

namespace infinigen::step_timing {

using Clock = std::chrono::steady_clock;

inline double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Adds the time of its scope to *seconds (when not null).
class ScopedTiming {
 public:
  explicit ScopedTiming(double* seconds) : seconds_(seconds) {
    if (seconds_ != nullptr) t0_ = Clock::now();
  }
  ~ScopedTiming() {
    if (seconds_ != nullptr) *seconds_ += Since(t0_);
  }
  ScopedTiming(const ScopedTiming&) = delete;
  ScopedTiming& operator=(const ScopedTiming&) = delete;

 private:
  double* seconds_;
  Clock::time_point t0_;
};

}  // namespace infinigen::step_timing
