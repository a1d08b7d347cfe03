// What the router checks of a GenerateRequest before it queues it: one input given and not
// empty, the prompt and the request within their limits, known chat roles, max_new_tokens in
// range, ids of a bounded size. INVALID_ARGUMENT naming the field and the limit. Protobuf
// only (no gRPC): fuzzed with the request as bytes (tests/fuzz/generate_request_fuzz.cc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "infinigen/v1/generation.pb.h"

namespace infinigen {

struct RequestLimits {
  int64_t max_request_bytes = 1 << 20;
  int64_t max_prompt_tokens = 32768;
  int32_t max_new_tokens_limit = 4096;
};

// The longest request_id and session_id.
inline constexpr size_t kMaxRequestIdBytes = 256;
// The most samples of one prompt a request may ask (sampling.n), as the workers allow.
inline constexpr int kMaxSamples = 16;

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const RequestLimits& limits);

}  // namespace infinigen
