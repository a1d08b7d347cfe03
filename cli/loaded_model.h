// A checkpoint loaded onto a backend, as the CLI commands use it, the flags that pick the
// backend, and the sampling flags of the commands that generate (locally or through a server).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen::cli {

// --device, --threads, --cpu-weights, --cpu-kv and --cuda-dtype, shared by every command that runs
// the model.
struct BackendFlags {
  std::string device = "cpu";  // cpu | cuda
  int64_t threads = 0;
  std::string cpu_weights = "f32";
  std::string cpu_kv = "f32";  // CpuBackendOptions::kv_dtype: f32 | bf16
  std::string cuda_dtype = "bf16";
  bool batch_invariant = true;  // CpuBackendOptions::batch_invariant

  void Register(FlagSet& flags);
  absl::StatusOr<CpuBackendOptions> Options() const;
  // The chosen backend (FAILED_PRECONDITION for cuda without a GPU or in a build without CUDA).
  absl::StatusOr<std::unique_ptr<Backend>> Create() const;
};

// --max-tokens, --temperature, --top-k, --top-p, --min-p, --repetition-penalty, --seed,
// --ignore-eos.
struct SamplingFlags {
  int64_t max_tokens = 64, top_k = 0, seed = 0;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repetition_penalty = 1.0;
  bool ignore_eos = false;

  void Register(FlagSet& flags);
  // Validated (INVALID_ARGUMENT naming the field).
  absl::StatusOr<GenerateOptions> Options() const;
};

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// The checkpoint's own tokenizer: the one inside a GGUF, or the tokenizer files of a Hugging
// Face folder.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint);

// Opens `path` and loads it on the backend the flags choose.
absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendFlags& flags);

}  // namespace infinigen::cli
