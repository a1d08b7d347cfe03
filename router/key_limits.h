// What one API key may use of the router (a hostile or runaway client must not starve the
// others): at most `max_streams` of its requests in flight, and at most `requests_per_second`
// new ones on average with bursts of `burst` (a token bucket per key). 0 disables a limit.
// Refusals are RESOURCE_EXHAUSTED naming the limit, with the time after which a retry of that
// key can pass (the router sends it as grpc-retry-pushback-ms; HTTP as Retry-After).
#pragma once

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace infinigen {

struct KeyLimitsConfig {
  int max_streams = 0;
  double requests_per_second = 0;
  int burst = 0;  // 0 with a rate: one second's worth, at least 1

  // INVALID_ARGUMENT naming the flag.
  absl::Status Validate() const;
  bool any() const { return max_streams > 0 || requests_per_second > 0; }
};

class KeyLimits {
 public:
  KeyLimits(const KeyLimitsConfig& config, size_t num_keys);

  // A new request of key `key` (an index of ApiKeys) at `now`: OK (the caller Leaves when it
  // ends), or RESOURCE_EXHAUSTED with *retry_after set.
  absl::Status Enter(size_t key, absl::Time now, absl::Duration* retry_after);
  void Leave(size_t key);

  int streams(size_t key) const;

 private:
  struct Key {
    int streams = 0;
    double tokens = 0;  // the bucket
    absl::Time refilled = absl::InfinitePast();
  };
  const KeyLimitsConfig config_;
  const double capacity_;  // the bucket's size
  mutable absl::Mutex mu_;
  std::vector<Key> keys_ ABSL_GUARDED_BY(mu_);
};

// RAII: leaves on destruction when it holds a key.
class KeyLimitsLease {
 public:
  KeyLimitsLease() = default;
  KeyLimitsLease(KeyLimits* limits, size_t key) : limits_(limits), key_(key) {}
  ~KeyLimitsLease() {
    if (limits_ != nullptr) limits_->Leave(key_);
  }
  KeyLimitsLease(const KeyLimitsLease&) = delete;
  KeyLimitsLease& operator=(const KeyLimitsLease&) = delete;

 private:
  KeyLimits* limits_ = nullptr;
  size_t key_ = 0;
};

}  // namespace infinigen
