#include "cli/sampling_flags.h"

#include "common/status_macros.h"

namespace infinigen::cli {

void SamplingFlags::Register(FlagSet& flags) {
  flags.Int("max-tokens", &max_tokens, "most tokens to generate");
  flags.Float("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &top_k, "keep the k most likely tokens (0 = off)");
  flags.Float("top-p", &top_p, "nucleus sampling mass (1 = off)");
  flags.Float("min-p", &min_p, "drop tokens below min-p x the top probability (0 = off)");
  flags.Float("repetition-penalty", &repetition_penalty, "penalty for repeated tokens (1 = off)");
  flags.Float("presence-penalty", &presence_penalty,
              "subtracted from the logits of tokens already generated, in [-2, 2] (0 = off)");
  flags.Float("frequency-penalty", &frequency_penalty,
              "subtracted once per time a token was generated, in [-2, 2] (0 = off)");
  flags.Int("seed", &seed, "random seed for sampling (client: 0 lets the server draw one)");
  flags.Bool("ignore-eos", &ignore_eos, "keep generating past end-of-sequence tokens");
}

absl::StatusOr<GenerateOptions> SamplingFlags::Options() const {
  GenerateOptions options;
  options.max_new_tokens = max_tokens;
  options.ignore_eos = ignore_eos;
  options.sampling.temperature = static_cast<float>(temperature);
  options.sampling.top_k = static_cast<int32_t>(top_k);
  options.sampling.top_p = static_cast<float>(top_p);
  options.sampling.min_p = static_cast<float>(min_p);
  options.sampling.repetition_penalty = static_cast<float>(repetition_penalty);
  options.sampling.presence_penalty = static_cast<float>(presence_penalty);
  options.sampling.frequency_penalty = static_cast<float>(frequency_penalty);
  options.sampling.seed = static_cast<uint64_t>(seed);
  IG_RETURN_IF_ERROR(options.Validate());
  return options;
}

}  // namespace infinigen::cli
