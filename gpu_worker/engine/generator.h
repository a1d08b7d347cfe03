// Generation of one sequence: chunked prefill of the prompt, then token-by-token decode with
// sampling and stop conditions. The local CLI and the tests use it; the serving engine batches
// many sequences with the same Model::Forward.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/generate_options.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/model/model.h"
#include "kernels/cpu/sampling.h"

namespace infinigen {

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
