#include "router/key_limits.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::Status KeyLimitsConfig::Validate() const {
  if (max_streams < 0) return absl::InvalidArgumentError("--max_streams_per_key must be >= 0");
  if (!(requests_per_second >= 0) || std::isinf(requests_per_second)) {
    return absl::InvalidArgumentError("--requests_per_second_per_key must be a number >= 0");
  }
  if (burst < 0) return absl::InvalidArgumentError("--request_burst_per_key must be >= 0");
  return absl::OkStatus();
}

KeyLimits::KeyLimits(const KeyLimitsConfig& config, size_t num_keys)
    : config_(config),
      capacity_(config.burst > 0 ? config.burst : std::max(1.0, config.requests_per_second)),
      keys_(num_keys) {
  for (Key& k : keys_) k.tokens = capacity_;
}

absl::Status KeyLimits::Enter(size_t key, absl::Time now, absl::Duration* retry_after) {
  absl::MutexLock lock(&mu_);
  if (key >= keys_.size()) return absl::InternalError("an API key outside the key file");
  Key& k = keys_[key];
  if (config_.max_streams > 0 && k.streams >= config_.max_streams) {
    *retry_after = absl::Milliseconds(100);
    return absl::ResourceExhaustedError(
        absl::StrCat("this API key already has ", k.streams,
                     " requests in flight, its limit (max_streams_per_key); retry when one ends"));
  }
  if (config_.requests_per_second > 0) {
    if (k.refilled != absl::InfinitePast()) {
      k.tokens = std::min(capacity_, k.tokens + absl::ToDoubleSeconds(now - k.refilled) *
                                                    config_.requests_per_second);
    }
    k.refilled = now;
    if (k.tokens < 1.0) {
      *retry_after = absl::Seconds((1.0 - k.tokens) / config_.requests_per_second);
      return absl::ResourceExhaustedError(
          absl::StrCat("this API key sent more than ", config_.requests_per_second,
                       " requests per second (requests_per_second_per_key, bursts of ", capacity_,
                       "); retry in ", absl::ToInt64Milliseconds(*retry_after) + 1, " ms"));
    }
    k.tokens -= 1.0;
  }
  ++k.streams;
  return absl::OkStatus();
}

void KeyLimits::Leave(size_t key) {
  absl::MutexLock lock(&mu_);
  if (key < keys_.size() && keys_[key].streams > 0) --keys_[key].streams;
}

int KeyLimits::streams(size_t key) const {
  absl::MutexLock lock(&mu_);
  return key < keys_.size() ? keys_[key].streams : 0;
}

}  // namespace infinigen
