// A checkpoint loaded onto the backend a worker or a command chose, with its own tokenizer.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen {

// Where the model runs and how it is stored there (the worker's and the CLI's backend flags).
struct BackendSpec {
  std::string device = "cpu";        // cpu | cuda
  int64_t threads = 0;               // CPU threads, 0: all cores
  std::string pin_threads = "auto";  // CpuBackendOptions::pinning: auto | on | off
  std::string cpu_weights = "f32";
  std::string cpu_kv = "f32";  // CpuBackendOptions::kv_dtype: f32 | bf16
  std::string cuda_dtype = "bf16";
  bool batch_invariant = true;  // CpuBackendOptions::batch_invariant

  // Validated (INVALID_ARGUMENT naming the flag).
  absl::StatusOr<CpuBackendOptions> Options() const;
  // The chosen backend (FAILED_PRECONDITION for cuda without a GPU or in a build without CUDA).
  absl::StatusOr<std::unique_ptr<Backend>> Create() const;
};

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// The checkpoint's own tokenizer: the one inside a GGUF, or the tokenizer files of a Hugging
// Face folder.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint);

// Opens `path` and loads it on the chosen backend.
absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendSpec& choice);

}  // namespace infinigen
