#include "kernels/cpu/sampling_params.h"

#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"

namespace infinigen {

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0 (0 = greedy), got ", temperature));
  }
  if (top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0 (0 = off), got ", top_k));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "repetition_penalty must be a finite number > 0 (1 = off), got ", repetition_penalty));
  }
  for (const auto& [name, value] : {std::pair{"presence_penalty", presence_penalty},
                                    {"frequency_penalty", frequency_penalty}}) {
    if (!(value >= -kMaxOpenAiPenalty && value <= kMaxOpenAiPenalty)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be in [-2, 2] (0 = off), got ", value));
    }
  }
  return absl::OkStatus();
}

}  // namespace infinigen
