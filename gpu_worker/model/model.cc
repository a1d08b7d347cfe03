#include "gpu_worker/model/model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/model/random_weights.h"

namespace infinigen {

Model::Model(const ModelConfig& config, Backend& backend, ModelWeights weights)
    : config_(config), backend_(backend), weights_(std::move(weights)) {}

Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const Checkpoint& ckpt, Backend& backend) {
  IG_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(ckpt, backend));
  return std::unique_ptr<Model>(new Model(ckpt.config(), backend, std::move(weights)));
}

KvCacheShape Model::kv_shape() const {
  return {static_cast<int>(config_.num_layers), static_cast<int>(config_.num_kv_heads),
          static_cast<int>(config_.head_dim), backend_.kv_dtype()};
}

int64_t Model::NumLogitRows(std::span<const ModelChunk> batch) {
  int64_t rows = 0;
  for (const ModelChunk& c : batch) {
    rows += c.all_logits ? static_cast<int64_t>(c.tokens.size()) : (c.tokens.empty() ? 0 : 1);
  }
  return rows;
}

MatView Model::Activations(Buffer& b, int64_t rows, int64_t cols) const {
  return {b.data(), backend_.activation_dtype(), rows, cols, cols};
}

absl::Status Model::Reserve(int64_t tokens, int64_t logit_rows) {
  const size_t e = DTypeSize(backend_.activation_dtype());
  const ModelConfig& c = config_;
  auto grow = [&](std::unique_ptr<Buffer>& b, int64_t rows, int64_t cols,
                  size_t elem) -> absl::Status {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(rows * cols, 1)) * elem;
    if (b != nullptr && b->size() >= bytes) return absl::OkStatus();
    b.reset();  // release before allocating the larger one
    IG_ASSIGN_OR_RETURN(b, backend_.Allocate(bytes));
    return absl::OkStatus();
  };
  if (tokens > ws_.max_tokens) {
    const int64_t mlp_cols =
        c.architecture == Architecture::kLlama ? 2 * c.intermediate_size : c.intermediate_size;
    IG_RETURN_IF_ERROR(grow(ws_.ids, 2, tokens, sizeof(int32_t)));  // token ids, position ids
    IG_RETURN_IF_ERROR(grow(ws_.positions, 1, tokens, sizeof(int32_t)));
    IG_RETURN_IF_ERROR(grow(ws_.x, tokens, c.hidden_size, e));
    IG_RETURN_IF_ERROR(grow(ws_.h, tokens, std::max(c.hidden_size, c.embed_dim()), e));
    IG_RETURN_IF_ERROR(grow(ws_.qkv, tokens, c.q_dim() + 2 * c.kv_dim(), e));
    IG_RETURN_IF_ERROR(grow(ws_.attn, tokens, c.q_dim(), e));
    IG_RETURN_IF_ERROR(grow(ws_.mlp, tokens, mlp_cols, e));
    IG_RETURN_IF_ERROR(grow(ws_.act, tokens, c.intermediate_size, e));
    ws_.max_tokens = tokens;
  }
  if (logit_rows > ws_.max_logit_rows) {
    IG_RETURN_IF_ERROR(grow(ws_.sel, logit_rows, c.hidden_size, e));
    IG_RETURN_IF_ERROR(grow(ws_.sel_proj, logit_rows, c.embed_dim(), e));
    IG_RETURN_IF_ERROR(grow(ws_.logits, logit_rows, c.vocab_size, sizeof(float)));
    ws_.max_logit_rows = logit_rows;
  }
  return absl::OkStatus();
}

absl::Status Model::Norm(MatView x, const Weight& w, const Weight& b, MatView out) {
  if (config_.architecture == Architecture::kLlama) {
    return backend_.RmsNorm(x, w, config_.norm_eps, out);
  }
  return backend_.LayerNorm(x, w, b ? &b : nullptr, config_.norm_eps, out);
}

absl::Status Model::Embed(int64_t n) {
  const ModelConfig& c = config_;
  const int32_t* ids = static_cast<const int32_t*>(ws_.ids->data());
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  if (c.architecture == Architecture::kLlama) {
    return backend_.Embedding(weights_.embed, ids, x);
  }
  if (c.has_projections()) {
    MatView e = Activations(*ws_.h, n, c.word_embed_proj_dim);
    IG_RETURN_IF_ERROR(backend_.Embedding(weights_.embed, ids, e));
    IG_RETURN_IF_ERROR(backend_.Linear(e, weights_.project_in, nullptr, x, false));
  } else {
    IG_RETURN_IF_ERROR(backend_.Embedding(weights_.embed, ids, x));
  }
  MatView pos = Activations(*ws_.h, n, c.hidden_size);
  IG_RETURN_IF_ERROR(backend_.Embedding(weights_.positions, ids + ws_.max_tokens, pos));
  return backend_.Add(pos, x);
}

absl::Status Model::Mlp(const LayerWeights& L, int64_t n) {
  const ModelConfig& c = config_;
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView in = x;
  if (c.pre_norm) {
    in = Activations(*ws_.h, n, c.hidden_size);
    IG_RETURN_IF_ERROR(Norm(x, L.mlp_norm, L.mlp_norm_bias, in));
  }
  const Weight* up_bias = L.up_bias ? &L.up_bias : nullptr;
  const Weight* down_bias = L.down_bias ? &L.down_bias : nullptr;
  MatView act = Activations(*ws_.act, n, c.intermediate_size);
  if (c.architecture == Architecture::kLlama) {
    MatView gate_up = Activations(*ws_.mlp, n, 2 * c.intermediate_size);
    IG_RETURN_IF_ERROR(backend_.Linear(in, L.up, up_bias, gate_up, false));
    IG_RETURN_IF_ERROR(backend_.SwiGlu(gate_up.Cols(0, c.intermediate_size),
                                       gate_up.Cols(c.intermediate_size, c.intermediate_size),
                                       act));
  } else {
    IG_RETURN_IF_ERROR(backend_.Linear(in, L.up, up_bias, act, false));
    IG_RETURN_IF_ERROR(backend_.Relu(act));
  }
  IG_RETURN_IF_ERROR(backend_.Linear(act, L.down, down_bias, x, /*accumulate=*/true));
  if (!c.pre_norm) IG_RETURN_IF_ERROR(Norm(x, L.mlp_norm, L.mlp_norm_bias, x));
  return absl::OkStatus();
}

absl::Status Model::Logits(std::span<const ModelChunk> batch, int64_t n, std::span<float> out) {
  const ModelConfig& c = config_;
  const int64_t rows = NumLogitRows(batch);
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView sel = Activations(*ws_.sel, rows, c.hidden_size);
  int64_t src = 0, dst = 0;
  for (const ModelChunk& chunk : batch) {
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    if (chunk.all_logits) {
      IG_RETURN_IF_ERROR(backend_.Copy(x.Rows(src, len), sel.Rows(dst, len)));
      dst += len;
    } else if (len > 0) {
      IG_RETURN_IF_ERROR(backend_.Copy(x.Rows(src + len - 1, 1), sel.Rows(dst, 1)));
      dst += 1;
    }
    src += len;
  }
  if (c.architecture == Architecture::kLlama || c.final_norm) {
    IG_RETURN_IF_ERROR(Norm(sel, weights_.final_norm, weights_.final_norm_bias, sel));
  }
  MatView head_in = sel;
  if (c.has_projections()) {
    head_in = Activations(*ws_.sel_proj, rows, c.word_embed_proj_dim);
    IG_RETURN_IF_ERROR(backend_.Linear(sel, weights_.project_out, nullptr, head_in, false));
  }
  // Logits are float32 whatever the activations are (the backend's Linear widens).
  MatView logits{ws_.logits->data(), DType::kF32, rows, c.vocab_size, c.vocab_size};
  IG_RETURN_IF_ERROR(backend_.Linear(head_in, weights_.output(), nullptr, logits, false));
  // CopyToHost waits for the step: no separate synchronize.
  return backend_.CopyToHost(logits.data, out.data(), static_cast<size_t>(rows * c.vocab_size) * 4);
}

absl::Status Model::Forward(std::span<const ModelChunk> batch, LayerAttention& attention,
                            std::span<float> logits) {
  const ModelConfig& c = config_;
  int64_t n = 0;
  for (const ModelChunk& chunk : batch) n += static_cast<int64_t>(chunk.tokens.size());
  const int64_t rows = NumLogitRows(batch);
  if (static_cast<int64_t>(logits.size()) < rows * c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("logits buffer holds ", logits.size(),
                                                   " floats, ", rows * c.vocab_size, " needed"));
  }
  if (n == 0) return absl::OkStatus();

  host_ids_.resize(2 * n);
  host_positions_.resize(n);
  int64_t i = 0;
  for (const ModelChunk& chunk : batch) {
    for (size_t t = 0; t < chunk.tokens.size(); ++t, ++i) {
      const int32_t id = chunk.tokens[t];
      if (id < 0 || id >= c.vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
      }
      const int64_t pos = chunk.start + static_cast<int64_t>(t);
      if (c.architecture == Architecture::kOpt && pos >= c.max_position_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat("position ", pos, " exceeds the model's ",
                                                       c.max_position_embeddings,
                                                       " learned positions"));
      }
      host_ids_[i] = id;
      host_positions_[i] = static_cast<int32_t>(pos);
    }
  }
  IG_RETURN_IF_ERROR(Reserve(n, rows));
  // Token ids at ids[0, n), learned-position ids (OPT) at ids[max_tokens, max_tokens + n).
  for (int64_t t = 0; t < n; ++t) {
    host_ids_[n + t] = host_positions_[t] + static_cast<int32_t>(c.position_offset);
  }
  int32_t* dev_ids = static_cast<int32_t*>(ws_.ids->data());
  IG_RETURN_IF_ERROR(backend_.CopyToDevice(host_ids_.data(), dev_ids, n * sizeof(int32_t)));
  IG_RETURN_IF_ERROR(
      backend_.CopyToDevice(host_ids_.data() + n, dev_ids + ws_.max_tokens, n * sizeof(int32_t)));
  IG_RETURN_IF_ERROR(
      backend_.CopyToDevice(host_positions_.data(), ws_.positions->data(), n * sizeof(int32_t)));

  IG_RETURN_IF_ERROR(Embed(n));
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView h = Activations(*ws_.h, n, c.hidden_size);
  MatView qkv = Activations(*ws_.qkv, n, c.q_dim() + 2 * c.kv_dim());
  MatView q = qkv.Cols(0, c.q_dim());
  MatView k = qkv.Cols(c.q_dim(), c.kv_dim());
  MatView v = qkv.Cols(c.q_dim() + c.kv_dim(), c.kv_dim());
  MatView attn = Activations(*ws_.attn, n, c.q_dim());
  const int32_t* dev_positions = positions();
  const float* inv_freq =
      weights_.rope_inv_freq ? static_cast<const float*>(weights_.rope_inv_freq->data()) : nullptr;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& L = weights_.layers[layer];
    MatView in = x;
    if (c.pre_norm) {
      IG_RETURN_IF_ERROR(Norm(x, L.attn_norm, L.attn_norm_bias, h));
      in = h;
    }
    IG_RETURN_IF_ERROR(attention.BeforeLayer(layer, in, x));
    IG_RETURN_IF_ERROR(backend_.Linear(in, L.qkv, L.qkv_bias ? &L.qkv_bias : nullptr, qkv, false));
    if (c.architecture == Architecture::kLlama) {
      IG_RETURN_IF_ERROR(backend_.Rope(q, c.num_heads, c.head_dim, c.rope.rotary_dim, dev_positions,
                                       inv_freq, c.rope.layout));
      IG_RETURN_IF_ERROR(backend_.Rope(k, c.num_kv_heads, c.head_dim, c.rope.rotary_dim,
                                       dev_positions, inv_freq, c.rope.layout));
    }
    IG_RETURN_IF_ERROR(attention.Attend(layer, q, k, v, attn));
    IG_RETURN_IF_ERROR(backend_.Linear(attn, L.o, L.o_bias ? &L.o_bias : nullptr, x, true));
    if (!c.pre_norm) IG_RETURN_IF_ERROR(Norm(x, L.attn_norm, L.attn_norm_bias, x));
    IG_RETURN_IF_ERROR(Mlp(L, n));
  }
  return Logits(batch, n, logits);
}

const int32_t* Model::positions() const {
  return ws_.positions ? static_cast<const int32_t*>(ws_.positions->data()) : nullptr;
}

absl::StatusOr<std::unique_ptr<Model>> Model::LoadRandom(const ModelConfig& config,
                                                         Backend& backend, uint64_t seed) {
  IG_RETURN_IF_ERROR(config.Validate("random model"));
  IG_ASSIGN_OR_RETURN(ModelWeights weights, RandomWeights(config, backend, seed));
  std::unique_ptr<Model> m(new Model(config, backend, std::move(weights)));
  m->random_seed_ = seed;
  return m;
}

absl::Status Model::AttachSpeculation(const Checkpoint& ckpt, const PartialChannels& channels) {
  return BuildSpeculation(Speculation::FromCheckpoint(ckpt), channels);
}

absl::Status Model::AttachSpeculation(const PartialChannels& channels) {
  if (!random_seed_.has_value()) {
    return absl::FailedPreconditionError(
        "this model was loaded from a checkpoint: attach the speculation from it");
  }
  const uint64_t seed = *random_seed_;
  const ModelConfig& c = config_;
  return BuildSpeculation(
      [seed, &c](int layer, std::vector<float>& w, std::vector<float>& b) {
        w = RandomQueryWeight(c, seed, layer);
        b.clear();
        return absl::OkStatus();
      },
      channels);
}

absl::Status Model::BuildSpeculation(const Speculation::QueryWeights& query_weights,
                                     const PartialChannels& channels) {
  std::vector<float> inv_freq;
  if (weights_.rope_inv_freq != nullptr) {
    inv_freq.resize(static_cast<size_t>(config_.rope.rotary_dim / 2));
    IG_RETURN_IF_ERROR(backend_.CopyToHost(weights_.rope_inv_freq->data(), inv_freq.data(),
                                           inv_freq.size() * sizeof(float)));
    IG_RETURN_IF_ERROR(backend_.Synchronize());
  }
  IG_ASSIGN_OR_RETURN(speculation_,
                      Speculation::Build(config_, query_weights, channels, inv_freq, backend_));
  return absl::OkStatus();
}

absl::Status Model::AttentionNorm(int layer, MatView residual, MatView out) {
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  const LayerWeights& L = weights_.layers[layer];
  return Norm(residual, L.attn_norm, L.attn_norm_bias, out);
}

absl::Status Model::SpeculatePartialQuery(int layer, MatView input, const int32_t* positions,
                                          MatView scratch, MatView out) {
  if (speculation_ == nullptr) {
    return absl::FailedPreconditionError(
        "the model has no speculation weights: attach an InfiniGen sidecar's partial channels");
  }
  return speculation_->Run(layer, input, positions, scratch, out);
}

}  // namespace infinigen
