// What a sampler draws with (kernels/cpu/sampling.h), as a plain value with its valid ranges:
// the request front end (frontend/) checks requests against them without linking the kernels.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace infinigen {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // 1 = off
  float min_p = 0.0f;               // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off; > 1 discourages tokens already in the sequence
  uint64_t seed = 0;

  bool greedy() const { return temperature == 0.0f; }
  // INVALID_ARGUMENT naming the field and its allowed range.
  absl::Status Validate() const;
};

}  // namespace infinigen
