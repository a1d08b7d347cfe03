// The decoder-only transformer of the Llama family and OPT, written once against Backend.
// Forward() runs a ragged batch: each chunk is some new tokens of one sequence (a whole prompt,
// a prefill chunk, or one decode token), so prefill and decode share one code path and
// continuous batching can mix them in a step. The model knows nothing of KV caches or
// selection policies: each layer's attention is asked of a LayerAttention (the decode step).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/config.h"
#include "gpu_worker/model/layer_attention.h"
#include "gpu_worker/model/speculation.h"
#include "gpu_worker/model/weights.h"

namespace infinigen {

// Some new tokens of one sequence: a whole prompt, a prefill chunk, or one decode token.
struct ModelChunk {
  int64_t start = 0;                // tokens of the sequence before these (= first position)
  std::span<const int32_t> tokens;  // the new tokens
  bool all_logits = false;          // logits of every new token, else of the last one only
};

class Model {
 public:
  // Loads every weight of `ckpt` onto `backend`, which must outlive the model.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Checkpoint& ckpt, Backend& backend);
  // A Llama-shaped model of random weights (model/random_weights.h), for benchmarks of shapes
  // no checkpoint is at hand for.
  static absl::StatusOr<std::unique_ptr<Model>> LoadRandom(const ModelConfig& config,
                                                           Backend& backend, uint64_t seed);
  ~Model();

  const ModelConfig& config() const { return config_; }
  Backend& backend() const { return backend_; }
  // The K/V layout a cache for this model must have.
  KvCacheShape kv_shape() const;

  // Logit rows that Forward writes for `batch`: per chunk, all its tokens or its last one.
  static int64_t NumLogitRows(std::span<const ModelChunk> batch);

  // Runs `batch` through every layer, with `attention` doing each layer's attention (and
  // whatever it needs to do before the layer: it owns the K/V), and writes float32 logits
  // [NumLogitRows(batch), vocab_size] to host memory `logits`, chunk by chunk in order.
  // INVALID_ARGUMENT for out-of-range token ids or positions.
  absl::Status Forward(std::span<const ModelChunk> batch, LayerAttention& attention,
                       std::span<float> logits);
  // Device positions [tokens] of the batch Forward is running (valid inside its callbacks).
  const int32_t* positions() const;

  // ---- InfiniGen speculation (INFINIGEN.md, decode step 2) ----

  // Builds the speculation's weights from the partial channels of a sidecar (A[:, P] per KV
  // head of every layer): the cheapest exact form for this model (speculation.h). Replaces any
  // attached before.
  absl::Status AttachSpeculation(const Checkpoint& ckpt, const PartialChannels& channels);
  // The same for a model of random weights (LoadRandom), from the values it was filled with.
  absl::Status AttachSpeculation(const PartialChannels& channels);
  // What AttachSpeculation built; null before.
  const Speculation* speculation() const { return speculation_.get(); }
  // `layer`'s own attention norm of `residual` into `out` (the speculation input that uses the
  // next layer's norm weights on the previous layer's residual).
  absl::Status AttentionNorm(int layer, MatView residual, MatView out);
  // The partial query q~ [rows, num_heads * partial_dim] of `layer` from `input` [rows, hidden]
  // at device `positions` [rows]: post-RoPE, on each KV head's A[:, P]. `scratch`: [rows,
  // num_heads * head_dim] activations the speculation may use. FAILED_PRECONDITION without
  // AttachSpeculation.
  absl::Status SpeculatePartialQuery(int layer, MatView input, const int32_t* positions,
                                     MatView scratch, MatView out);

 private:
  Model(const ModelConfig& config, Backend& backend, ModelWeights weights);

  // Scratch activations, sized for a number of tokens and logit rows; grows only.
  struct Workspace {
    int64_t max_tokens = 0;
    int64_t max_logit_rows = 0;
    std::unique_ptr<Buffer> ids, positions, x, h, qkv, attn, mlp, act, sel, sel_proj, logits;
  };
  absl::Status Reserve(int64_t tokens, int64_t logit_rows);
  MatView Activations(Buffer& b, int64_t rows, int64_t cols) const;

  absl::Status Embed(int64_t num_tokens);
  absl::Status Norm(MatView x, const Weight& w, const Weight& b, MatView out);
  absl::Status Mlp(const LayerWeights& L, int64_t num_tokens);
  absl::Status Logits(std::span<const ModelChunk> batch, int64_t num_tokens, std::span<float> out);

  ModelConfig config_;
  Backend& backend_;
  ModelWeights weights_;
  Workspace ws_;
  std::vector<int32_t> host_ids_, host_positions_;
  std::unique_ptr<Speculation> speculation_;
  std::optional<uint64_t> random_seed_;  // LoadRandom's
  absl::Status BuildSpeculation(const Speculation::QueryWeights& query_weights,
                                const PartialChannels& channels);
};

}  // namespace infinigen
