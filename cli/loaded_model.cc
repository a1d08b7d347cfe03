#include "cli/loaded_model.h"

#include "common/status_macros.h"
#include "gpu_worker/backend/cuda_plugin.h"

namespace infinigen::cli {

void BackendFlags::Register(FlagSet& flags) {
  flags.String("device", &device, "where the model runs: cpu or cuda (GPU 0)");
  flags.String("cuda-dtype", &cuda_dtype,
               "storage of activations, weights and K/V on the GPU: bf16, f16 or f32 (exact)");
  flags.Int("threads", &threads, "CPU threads (0 = all cores)");
  flags.String(
      "cpu-weights", &cpu_weights,
      "weight storage on the CPU: f32 (exact), bf16, q8 (faster decode) or q4_1 (a GGUF "
      "file's Q4_0/Q4_1/Q4_K matrices' values as they are, the others q8: fastest decode)");
  flags.String("cpu-kv", &cpu_kv,
               "K/V storage on the CPU: f32 (exact) or bf16 (half the bytes a long-context decode "
               "step reads)");
  flags.Bool("batch-invariant", &batch_invariant,
             "a sequence's logits do not depend on the sequences batched with it (CPU; false: "
             "OpenBLAS for prefill, faster, batch-dependent rounding)");
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
  if (cpu_kv != "f32" && cpu_kv != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu-kv must be f32 or bf16, got '", cpu_kv, "'"));
  }
  options.kv_dtype = cpu_kv == "bf16" ? DType::kBF16 : DType::kF32;
  options.batch_invariant = batch_invariant;
  if (device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu or cuda, got '", device, "'"));
  }
  if (!ParseDType(cuda_dtype).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda-dtype must be bf16, f16 or f32, got '", cuda_dtype, "'"));
  }
  return options;
}

absl::StatusOr<std::unique_ptr<Backend>> BackendFlags::Create() const {
  IG_ASSIGN_OR_RETURN(CpuBackendOptions options, Options());
  if (device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(options));
  IG_ASSIGN_OR_RETURN(DType dtype, ParseDType(cuda_dtype));
  return LoadCudaBackend(/*device=*/0, dtype);
}

void SamplingFlags::Register(FlagSet& flags) {
  flags.Int("max-tokens", &max_tokens, "most tokens to generate");
  flags.Float("temperature", &temperature, "sampling temperature; 0 = greedy");
  flags.Int("top-k", &top_k, "keep the k most likely tokens (0 = off)");
  flags.Float("top-p", &top_p, "nucleus sampling mass (1 = off)");
  flags.Float("min-p", &min_p, "drop tokens below min-p x the top probability (0 = off)");
  flags.Float("repetition-penalty", &repetition_penalty, "penalty for repeated tokens (1 = off)");
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
  options.sampling.seed = static_cast<uint64_t>(seed);
  IG_RETURN_IF_ERROR(options.Validate());
  return options;
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendFlags& flags) {
  LoadedModel m;
  IG_ASSIGN_OR_RETURN(m.backend, flags.Create());
  IG_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::Open(path));
  IG_ASSIGN_OR_RETURN(m.model, Model::Load(*m.checkpoint, *m.backend));
  return m;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint) {
  if (checkpoint.gguf() != nullptr)
    return Tokenizer::FromGguf(*checkpoint.gguf(), checkpoint.path());
  return Tokenizer::Load(checkpoint.path());
}

}  // namespace infinigen::cli
