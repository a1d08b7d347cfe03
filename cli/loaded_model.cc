#include "cli/loaded_model.h"

#include "common/status_macros.h"

namespace infinigen::cli {

void BackendFlags::Register(FlagSet& flags) {
  flags.Int("threads", &threads, "CPU threads (0 = all cores)");
  flags.String("cpu-weights", &cpu_weights,
               "weight storage on the CPU: f32 (exact), bf16 or q8 (faster decode)");
}

absl::StatusOr<CpuBackendOptions> BackendFlags::Options() const {
  CpuBackendOptions options;
  if (threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  options.num_threads = static_cast<int>(threads);
  auto format = ParseWeightFormat(cpu_weights);
  if (!format.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--cpu-weights: ", format.status().message()));
  }
  options.weight_format = *format;
  return options;
}

void SamplingFlags::Register(FlagSet& flags) {
  flags.Int("max-tokens", &max_tokens, "most tokens to generate");
  flags.Float("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &top_k, "keep the k most likely tokens (0 = off)");
  flags.Float("top-p", &top_p, "nucleus sampling mass (1 = off)");
  flags.Float("min-p", &min_p, "drop tokens below min-p x the top probability (0 = off)");
  flags.Float("repetition-penalty", &repetition_penalty, "penalty for repeated tokens (1 = off)");
  flags.Int("seed", &seed, "random seed for sampling");
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
  options.sampling.seed = static_cast<uint64_t>(seed);
  IG_RETURN_IF_ERROR(options.Validate());
  return options;
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendFlags& flags) {
  IG_ASSIGN_OR_RETURN(CpuBackendOptions options, flags.Options());
  LoadedModel m;
  IG_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::Open(path));
  m.backend = std::make_unique<CpuBackend>(options);
  IG_ASSIGN_OR_RETURN(m.model, Model::Load(*m.checkpoint, *m.backend));
  return m;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint) {
  if (checkpoint.gguf() != nullptr)
    return Tokenizer::FromGguf(*checkpoint.gguf(), checkpoint.path());
  return Tokenizer::Load(checkpoint.path());
}

}  // namespace infinigen::cli
