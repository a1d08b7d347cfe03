#include "frontend/generate_options.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

absl::Status GenerateOptions::Validate() const {
  IG_RETURN_IF_ERROR(sampling.Validate());
  if (max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 0, got ", max_new_tokens));
  }
  if (min_tokens < 0 || min_tokens > max_new_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("stopping.min_tokens must be in [0, max_new_tokens = ", max_new_tokens,
                     "], got ", min_tokens));
  }
  if (logit_bias.size() > static_cast<size_t>(kMaxLogitBias)) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias has ", logit_bias.size(),
                                                   " entries; at most ", kMaxLogitBias));
  }
  for (const auto& [id, bias] : logit_bias) {
    if (!(bias >= -kMaxAbsLogitBias && bias <= kMaxAbsLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias[", id, "] must be in [-",
                                                     kMaxAbsLogitBias, ", ", kMaxAbsLogitBias,
                                                     "], got ", bias));
    }
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.logprobs must be in [0, ",
                                                   kMaxLogprobs, "] (alternatives per token), got ",
                                                   logprobs));
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.prompt_logprobs must be in [0, ",
                                                   kMaxLogprobs, "] (alternatives per token), got ",
                                                   prompt_logprobs));
  }
  if (prefill_chunk_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk_tokens must be > 0, got ", prefill_chunk_tokens));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
