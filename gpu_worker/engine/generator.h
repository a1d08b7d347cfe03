// Generation of one sequence: chunked prefill of the prompt, then token-by-token decode with
// sampling and stop conditions. The local CLI and the tests use it; the serving engine batches
// many sequences with the same Model::Forward.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/model/model.h"
#include "kernels/cpu/sampling.h"

namespace infinigen {

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

  // INVALID_ARGUMENT naming the field.
  absl::Status Validate() const;
};

enum class FinishReason { kLength, kStop, kCancelled };
const char* FinishReasonName(FinishReason r);

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated tokens; a stop token that ended it is included
  FinishReason finish_reason = FinishReason::kLength;
  int64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;  // until the first token was sampled
  double decode_seconds = 0.0;   // the rest
};

// Called with each generated token; returning false cancels generation.
using TokenCallback = std::function<bool(int32_t token)>;

// Generates a continuation of `prompt` as sequence `seq` of `cache` (opened and closed here).
absl::StatusOr<GenerateResult> Generate(Model& model, KvCache& cache, SequenceId seq,
                                        std::span<const int32_t> prompt,
                                        const GenerateOptions& options,
                                        const TokenCallback& on_token = {});

}  // namespace infinigen
