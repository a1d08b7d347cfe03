// Random weights of a model shape, for benchmarks of shapes whose checkpoints cannot be had here
// (Llama-3.1-8B): every value is a pure function of (seed, tensor, index), the counter hash of
// kernels/cuda FillRandom (splitmix64), so a GPU backend fills its weights on the device and the
// host can recompute any of them (the speculation's W_q rows) bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/model/config.h"
#include "gpu_worker/model/weights.h"

namespace infinigen {

// The seed of tensor `tensor` (0, 1, ...) of a model filled with `seed`.
uint64_t RandomTensorSeed(uint64_t seed, int64_t tensor);

// A Llama-family model's weights, random (norm weights 1, projections scaled by 1/sqrt(fan-in)
// so activations stay of order 1). INVALID_ARGUMENT for OPT.
absl::StatusOr<ModelWeights> RandomWeights(const ModelConfig& config, Backend& backend,
                                           uint64_t seed);

// W_q of `layer` of such a model as float32, [q_dim, hidden] (what the speculation multiplies).
std::vector<float> RandomQueryWeight(const ModelConfig& config, uint64_t seed, int layer);

}  // namespace infinigen
