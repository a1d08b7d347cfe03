// What one generation may do, as the engine and the generator take it: sampling, how many
// tokens, what stops it, which log-probabilities it reports. A request's options are built and
// checked once, at the request front end (frontend/request_validation.h); Validate() is the one
// definition of the values they may hold.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cpu/sampling_params.h"

namespace infinigen {

// The most alternatives a logprobs or prompt_logprobs request may ask per token.
inline constexpr int kMaxLogprobs = 20;
// The most logit_bias entries, and the bound of each bias.
inline constexpr int kMaxLogitBias = 300;
inline constexpr float kMaxAbsLogitBias = 100.0f;

struct GenerateOptions {
  SamplingParams sampling;
  int64_t max_new_tokens = 128;
  std::vector<int32_t> stop_token_ids;  // besides the model's EOS ids (unless ignore_eos)
  bool ignore_eos = false;
  int64_t prefill_chunk_tokens = 512;  // prompt tokens per forward pass
  // Log-probabilities of each generated token (ComputeLogprobs) and of the `logprobs` most
  // likely alternatives, at most 20; -1: none (BatchEngine only).
  int logprobs = -1;
  // Log-probabilities of each prompt token after the first, given the tokens before it, and of
  // the `prompt_logprobs` most likely tokens at each position, at most 20; -1: none
  // (BatchEngine only; a request asking for them prefills its whole prompt).
  int prompt_logprobs = -1;
  int64_t min_tokens = 0;  // stop and EOS tokens cannot end generation before this many
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits before sampling
  // The text must be one JSON object (response_format JSON_OBJECT): the worker masks each
  // token's logits with it (gpu_worker/structured/json_token_mask.h).
  bool json_object = false;

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
  // What only the model can say, for `prompt` under these options: the prompt not empty, every
  // prompt and logit_bias token id inside the vocabulary, the prompt and max_new_tokens within
  // the context. INVALID_ARGUMENT naming what to fix. The engine and the generator both ask it
  // (one definition of the model's limits).
  absl::Status ValidateForModel(std::span<const int32_t> prompt, int64_t vocab_size,
                                int64_t context_tokens) const;
};

// INVALID_ARGUMENT naming the first token id outside [0, vocab_size).
absl::Status CheckTokenIds(std::span<const int32_t> ids, int64_t vocab_size);

}  // namespace infinigen
