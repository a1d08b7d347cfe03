// A checkpoint loaded onto a backend, as the CLI commands use it, and the flags that pick the
// backend.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/tokenizer/tokenizer.h"

namespace infinigen::cli {

// --threads and --cpu-weights, shared by every command that runs the model.
struct BackendFlags {
  int64_t threads = 0;
  std::string cpu_weights = "f32";

  void Register(FlagSet& flags);
  absl::StatusOr<CpuBackendOptions> Options() const;
};

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// The checkpoint's own tokenizer: the one inside a GGUF, or the tokenizer files of a Hugging
// Face folder.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const Checkpoint& checkpoint);

// Opens `path` and loads it on the CPU backend.
absl::StatusOr<LoadedModel> LoadModel(const std::string& path, const BackendFlags& flags);

}  // namespace infinigen::cli
