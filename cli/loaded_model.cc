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
