// The model's weights in backend memory, laid out for the layer loop: Q, K and V are fused into
// one matrix (one GEMM per layer), and so are Llama's gate and up projections.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/model/checkpoint.h"

namespace infinigen {

struct LayerWeights {
  Weight attn_norm, attn_norm_bias;  // [1, hidden]; bias: OPT only
  Weight qkv, qkv_bias;              // [q_dim + 2 * kv_dim, hidden]: Q rows, then K, then V
  Weight o, o_bias;                  // [hidden, q_dim]
  Weight mlp_norm, mlp_norm_bias;    // [1, hidden]
  Weight up, up_bias;      // Llama: [2 * intermediate, hidden], gate rows then up; OPT: fc1
  Weight down, down_bias;  // [hidden, intermediate]
};

struct ModelWeights {
  Weight embed;                           // [vocab, embed_dim]
  Weight positions;                       // OPT: [max_positions + offset, hidden]
  Weight project_in, project_out;         // OPT with word_embed_proj_dim != hidden
  Weight final_norm, final_norm_bias;     // [1, hidden]
  Weight lm_head;                         // [vocab, embed_dim]; empty when tied to embed
  std::unique_ptr<Buffer> rope_inv_freq;  // float32 [rotary_dim / 2], Llama only
  std::vector<LayerWeights> layers;

  const Weight& output() const { return lm_head ? lm_head : embed; }
};

// Reads every tensor the config calls for, checks its shape, and uploads it. Errors name the
// file and the tensor.
absl::StatusOr<ModelWeights> LoadWeights(const Checkpoint& ckpt, Backend& backend);

}  // namespace infinigen
