// A checkpoint loaded on the CPU backend, for tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"

namespace infinigen::testing {

struct LoadedModel {
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<CpuBackend> backend;
  std::unique_ptr<Model> model;
};

// Opens and loads `dir` (records test failures; `model` is null when loading failed).
LoadedModel LoadModel(const std::string& dir);

// `n` token ids in [0, vocab), the same for the same seed.
std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, unsigned seed);

}  // namespace infinigen::testing
