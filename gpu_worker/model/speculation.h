// InfiniGen's speculation weights (INFINIGEN.md, decode step 2): what a decode step multiplies
// the previous layer's attention input by to predict layer i's partial query q~ = RoPE(W_q x) .
// A[:, P] per head, in the cheapest exact form the model allows. Never the K/V projection.
//
//   kFoldedQuery  no RoPE (OPT): A[:, P] folded into W_q's rows, so q~ = x . W'^T + b': d'/d of
//                 the Q projection.
//   kRopePairs    RoPE, partial channels made of whole RoPE pairs and not skewed (A[:, P] picks
//                 channels): the rows of W_q for those channels, then RoPE on the pairs with
//                 each head's own frequencies: d'/d of the Q projection.
//   kFullQuery    RoPE with a skew (post-RoPE A cannot be folded into W_q): the Q projection,
//                 RoPE, then each head times A[:, P] (Q and H.d.d' of the K/V projection's
//                 cost saved, not more).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/rope_pairs.h"

namespace infinigen {

// The partial channels of every layer (from an InfiniGen sidecar): per layer, A[:, P] of each KV
// head, [num_kv_heads, head_dim, partial_dim] f32 row-major. `channels` and `skewed` say whether
// A[:, P] merely picks channels (unskewed): then channels[layer] lists them, [num_kv_heads,
// partial_dim], in the column order of A[:, P].
struct PartialChannels {
  int partial_dim = 0;
  bool skewed = true;
  std::vector<std::vector<float>> partial_skew;  // [layer] -> [num_kv_heads, head_dim, partial_dim]
  std::vector<std::vector<int32_t>> channels;    // [layer] -> [num_kv_heads, partial_dim]
};

class Speculation {
 public:
  enum class Mode { kFoldedQuery, kRopePairs, kFullQuery };

  // W_q of a layer ([q_dim, hidden]) and its bias ([q_dim], empty without one) as float32.
  using QueryWeights =
      std::function<absl::Status(int layer, std::vector<float>& w, std::vector<float>& b)>;
  // The reader of a checkpoint's W_q (and bias).
  static QueryWeights FromCheckpoint(const Checkpoint& ckpt);

  // Builds the weights of every layer of a model shaped `config` from its float W_q on
  // `backend`. `inv_freq`: the model's RoPE inverse frequencies (rotary_dim / 2, host), Llama
  // only.
  static absl::StatusOr<std::unique_ptr<Speculation>> Build(const ModelConfig& config,
                                                            const QueryWeights& query_weights,
                                                            const PartialChannels& channels,
                                                            const std::vector<float>& inv_freq,
                                                            Backend& backend);

  Mode mode() const { return mode_; }
  int partial_dim() const { return partial_dim_; }
  // Multiply-adds per token of one layer's speculation, and of that layer's Q/K/V projection
  // (the cost the issue compares it with).
  int64_t MacsPerToken() const { return macs_per_token_; }
  int64_t QkvMacsPerToken() const { return qkv_macs_per_token_; }

  // q~ [rows, num_heads * partial_dim] of `layer` from `input` [rows, hidden] at device
  // `positions` [rows]. `scratch` holds [rows, num_heads * head_dim] activations (kFullQuery).
  absl::Status Run(int layer, MatView input, const int32_t* positions, MatView scratch,
                   MatView out) const;

 private:
  struct Layer {
    Weight weight, bias;  // [rows, hidden], [1, rows]: rows = num_heads * (partial or head) dim
    std::unique_ptr<Buffer> partial_skew;  // kFullQuery: [num_kv_heads, head_dim, partial_dim]
    std::unique_ptr<Buffer> inv_freq;      // kRopePairs: [num_heads, partial_dim / 2]
  };
  Speculation(Backend& backend, const ModelConfig& config) : backend_(backend), config_(config) {}

  Backend& backend_;
  ModelConfig config_;
  Mode mode_ = Mode::kFullQuery;
  int partial_dim_ = 0;
  int64_t macs_per_token_ = 0, qkv_macs_per_token_ = 0;
  std::unique_ptr<Buffer> positions_inv_freq_;  // kFullQuery: the model's [rotary_dim / 2]
  std::vector<Layer> layers_;
};

}  // namespace infinigen
