// A checkpoint loaded onto a backend, as the CLI commands use it.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

namespace infinigen::cli {

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
};

// Opens `path` and loads it on the CPU backend with `threads` threads (0: all cores).
absl::StatusOr<LoadedModel> LoadModel(const std::string& path, int threads);

}  // namespace infinigen::cli
