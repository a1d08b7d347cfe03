#include "gpu_worker/model/random_weights.h"

#include <cmath>

#include "common/status_macros.h"

namespace infinigen {
namespace {

// Tensors per layer in the order RandomWeights fills them (after the 2 model-level ones).
constexpr int64_t kPerLayer = 6;  // attn_norm, qkv, o, mlp_norm, up, down

float FanInScale(int64_t cols) { return 1.0f / std::sqrt(static_cast<float>(cols)); }

}  // namespace

uint64_t RandomTensorSeed(uint64_t seed, int64_t tensor) {
  return seed * 0x100000001B3ull + static_cast<uint64_t>(tensor) * 0x9E3779B97F4A7C15ull;
}

std::vector<float> RandomQueryWeight(const ModelConfig& c, uint64_t seed, int layer) {
  // The Q rows are the first rows of the fused QKV weight (tensor 2 + layer * kPerLayer + 1).
  const uint64_t s = RandomTensorSeed(seed, 2 + layer * kPerLayer + 1);
  std::vector<float> w(static_cast<size_t>(c.q_dim() * c.hidden_size));
  cpu::FillRandom(w.data(), static_cast<int64_t>(w.size()), s, FanInScale(c.hidden_size));
  return w;
}

absl::StatusOr<ModelWeights> RandomWeights(const ModelConfig& c, Backend& backend, uint64_t seed) {
  if (c.architecture != Architecture::kLlama) {
    return absl::InvalidArgumentError("random weights are made for Llama-family shapes only");
  }
  ModelWeights w;
  int64_t tensor = 0;
  auto random = [&](int64_t rows, int64_t cols, float scale) {
    return backend.UploadRandomWeight(rows, cols, RandomTensorSeed(seed, tensor++), scale);
  };
  auto ones = [&](int64_t n) -> absl::StatusOr<Weight> {
    ++tensor;
    std::vector<float> v(static_cast<size_t>(n), 1.0f);
    return backend.UploadWeight(v.data(), 1, n);
  };
  IG_ASSIGN_OR_RETURN(w.embed, random(c.vocab_size, c.hidden_size, 1.0f));
  IG_ASSIGN_OR_RETURN(w.final_norm, ones(c.hidden_size));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerWeights& L = w.layers.emplace_back();
    IG_ASSIGN_OR_RETURN(L.attn_norm, ones(c.hidden_size));
    IG_ASSIGN_OR_RETURN(
        L.qkv, random(c.q_dim() + 2 * c.kv_dim(), c.hidden_size, FanInScale(c.hidden_size)));
    IG_ASSIGN_OR_RETURN(L.o, random(c.hidden_size, c.q_dim(), FanInScale(c.q_dim())));
    IG_ASSIGN_OR_RETURN(L.mlp_norm, ones(c.hidden_size));
    IG_ASSIGN_OR_RETURN(L.up,
                        random(2 * c.intermediate_size, c.hidden_size, FanInScale(c.hidden_size)));
    IG_ASSIGN_OR_RETURN(
        L.down, random(c.hidden_size, c.intermediate_size, FanInScale(c.intermediate_size)));
  }
  if (!c.tie_word_embeddings) {
    IG_ASSIGN_OR_RETURN(w.lm_head, random(c.vocab_size, c.hidden_size, FanInScale(c.hidden_size)));
  }
  const std::vector<float> inv_freq = RopeInverseFrequencies(c.rope);
  IG_ASSIGN_OR_RETURN(w.rope_inv_freq, backend.Allocate(inv_freq.size() * sizeof(float)));
  IG_RETURN_IF_ERROR(backend.CopyToDevice(inv_freq.data(), w.rope_inv_freq->data(),
                                          inv_freq.size() * sizeof(float)));
  return w;
}

}  // namespace infinigen
