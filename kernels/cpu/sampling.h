// Token sampling: the reference for device-side sampling. Processors run in vLLM's order:
// repetition penalty, frequency and presence penalties, then Hugging Face's temperature, top-k,
// top-p, min-p; then one draw from the counter-based generator keyed by (seed, position).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/sampling_params.h"

namespace infinigen {

// Reusable buffers so that sampling allocates nothing in steady state.
struct SamplingScratch {
  std::vector<std::pair<float, int32_t>> candidates;
  std::vector<uint8_t> seen;    // all zero between calls
  std::vector<int32_t> counts;  // all zero between calls
};

// Picks the token at `position` (its index in the whole sequence, prompt included) from
// `logits` [vocab], which it modifies. `history` is every token id before it (prompt and
// generated), used by the repetition penalty; `output` is its generated tail (tokens resumed
// from another worker included), which the presence and frequency penalties count.
int32_t SampleToken(std::span<float> logits, const SamplingParams& params,
                    std::span<const int32_t> history, std::span<const int32_t> output,
                    uint64_t position, SamplingScratch& scratch);

// Log-probabilities under the model's own distribution: the log-softmax of `logits` [vocab]
// as the model produced them, before temperature, penalties and truncation (what vLLM reports
// by default), of `token`, and of the `top` most likely tokens, most likely first (ties: the
// lower id first). The normalizer is summed in double precision.
struct TokenLogprobs {
  float logprob = 0.0f;
  int64_t rank = 0;  // 1 + tokens more likely (ties: lower id first); 0 for an id out of range
  std::vector<std::pair<int32_t, float>> top;  // (token id, log-probability)
};
void ComputeLogprobs(std::span<const float> logits, int32_t token, int top, TokenLogprobs& out);

}  // namespace infinigen
