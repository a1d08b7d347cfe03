// What a request may ask, checked where it comes in: the router's public API (and through it
// the HTTP door's requests) and the worker's API, with the same functions and one limits
// struct, so that a fact about a request is defined once. One input given and not empty, within
// the limits; known chat roles; sampling and stopping within their ranges, turned into the
// GenerateOptions the engine runs; ids of a bounded size. INVALID_ARGUMENT naming the field and
// the limit. Protobuf only (no gRPC): fuzzed with the request as bytes
// (tests/fuzz/generate_request_fuzz.cc). What needs the model (token ids inside its vocabulary,
// a prompt inside its context) is the worker's to check.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "frontend/generate_options.h"
#include "infinigen/v1/generation.pb.h"

namespace infinigen {

// A server's limits on requests: the router's and the worker's flags fill one each, and
// `infinigen serve` one for both.
struct RequestLimits {
  int64_t max_request_bytes = 1 << 20;
  int64_t max_prompt_tokens = 32768;  // 0: none but the model's context (the worker's)
  int32_t max_new_tokens_limit = 4096;
  // Of a request that gives none; 0: the smaller of 256 and max_new_tokens_limit.
  int32_t default_max_new_tokens = 0;

  int32_t DefaultMaxNewTokens() const {
    return default_max_new_tokens > 0 ? default_max_new_tokens
                                      : std::min<int32_t>(256, max_new_tokens_limit);
  }
  // INVALID_ARGUMENT naming the limit (as its flag is spelled, without dashes).
  absl::Status Validate() const;
};

// A worker's defaults: no prompt limit but its model's context.
inline RequestLimits WorkerRequestLimits() {
  RequestLimits limits;
  limits.max_prompt_tokens = 0;
  return limits;
}

// The longest request_id and session_id.
inline constexpr size_t kMaxRequestIdBytes = 256;
// The most samples of one prompt a request may ask (sampling.n).
inline constexpr int kMaxSamples = 16;

// A request's sampling and stopping as the engine runs them (unset fields take the server's
// defaults: temperature 1, max_new_tokens = limits.DefaultMaxNewTokens()), after checking
// every range, sampling.n and the stop strings.
absl::StatusOr<GenerateOptions> RequestOptions(const v1::SamplingParams& sampling,
                                               const v1::StoppingCriteria& stopping,
                                               const RequestLimits& limits);

// Not empty, and each role one the chat templates know (system, user, assistant).
absl::Status ValidateChatMessages(const v1::ChatMessages& messages);

// Everything about a public request that does not need the model.
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const RequestLimits& limits);

}  // namespace infinigen
