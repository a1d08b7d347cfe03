// What a sampler draws with (kernels/cpu/sampling.h), as a plain value with its valid ranges:
// the request front end (frontend/) checks requests against them without linking the kernels.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace infinigen {

// The bound of presence_penalty and frequency_penalty either way (OpenAI's and vLLM's).
inline constexpr float kMaxOpenAiPenalty = 2.0f;

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy (argmax, lowest id on ties)
  int32_t top_k = 0;                // 0 = off
  float top_p = 1.0f;               // 1 = off
  float min_p = 0.0f;               // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off; > 1 discourages tokens already in the sequence
  // OpenAI's: subtracted from the logit of every token already generated (presence), and once
  // more for each time it was (frequency); the prompt's tokens do not count. In [-2, 2], 0 = off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;

  bool greedy() const { return temperature == 0.0f; }
  bool penalizes_output() const { return presence_penalty != 0.0f || frequency_penalty != 0.0f; }
  // INVALID_ARGUMENT naming the field and its allowed range.
  absl::Status Validate() const;
};

}  // namespace infinigen
