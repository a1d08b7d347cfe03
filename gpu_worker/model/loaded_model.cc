#include "gpu_worker/model/loaded_model.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/backend/cuda_plugin.h"

namespace infinigen {

absl::StatusOr<CpuBackendOptions> BackendSpec::Options() const {
  CpuBackendOptions options;
  if (threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  options.num_threads = static_cast<int>(threads);
  if (pin_threads == "on") {
    options.pinning = cpu::Pinning::kOn;
  } else if (pin_threads == "off") {
    options.pinning = cpu::Pinning::kOff;
  } else if (pin_threads != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--pin-threads must be auto, on or off, got '", pin_threads, "'"));
  }
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

absl::StatusOr<std::unique_ptr<Backend>> BackendSpec::Create() const {
  IG_ASSIGN_OR_RETURN(CpuBackendOptions options, Options());
  if (device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(options));
  IG_ASSIGN_OR_RETURN(DType dtype, ParseDType(cuda_dtype));
  return LoadCudaBackend(/*device=*/0, dtype);
}

absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendSpec& choice) {
  LoadedModel m;
  IG_ASSIGN_OR_RETURN(m.backend, choice.Create());
  IG_ASSIGN_OR_RETURN(m.checkpoint, Checkpoint::Open(path));
  IG_ASSIGN_OR_RETURN(m.model, Model::Load(*m.checkpoint, *m.backend));
  return m;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint) {
  if (checkpoint.gguf() != nullptr)
    return Tokenizer::FromGguf(*checkpoint.gguf(), checkpoint.path());
  return Tokenizer::Load(checkpoint.path());
}

}  // namespace infinigen
