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

absl::Status CheckTokenIds(std::span<const int32_t> ids, int64_t vocab_size) {
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token id ", id, " is outside the model's vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status GenerateOptions::ValidateForModel(std::span<const int32_t> prompt, int64_t vocab_size,
                                               int64_t context_tokens) const {
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt has no tokens");
  IG_RETURN_IF_ERROR(CheckTokenIds(prompt, vocab_size));
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("sampling.logit_bias: token id ", id,
                                                     " is outside the model's vocabulary [0, ",
                                                     vocab_size, ")"));
    }
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  if (total > context_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", prompt.size(), " tokens) + max_new_tokens (", max_new_tokens,
                     ") exceeds the model's context of ", context_tokens, " tokens"));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
