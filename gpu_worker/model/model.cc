#include "gpu_worker/model/model.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

Model::Model(const ModelConfig& config, Backend& backend, ModelWeights weights)
    : config_(config), backend_(backend), weights_(std::move(weights)) {}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const Checkpoint& ckpt, Backend& backend) {
  IG_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(ckpt, backend));
  return std::unique_ptr<Model>(new Model(ckpt.config(), backend, std::move(weights)));
}

KvCacheShape Model::kv_shape() const {
  return {static_cast<int>(config_.num_layers), static_cast<int>(config_.num_kv_heads),
          static_cast<int>(config_.head_dim), backend_.activation_dtype()};
}

int64_t Model::NumLogitRows(std::span<const ForwardChunk> batch) {
  int64_t rows = 0;
  for (const ForwardChunk& c : batch) {
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
    IG_RETURN_IF_ERROR(grow(ws_.spec_in, tokens, c.hidden_size, e));
    IG_RETURN_IF_ERROR(grow(ws_.spec_qkv[0], tokens, c.q_dim() + 2 * c.kv_dim(), e));
    IG_RETURN_IF_ERROR(grow(ws_.spec_qkv[1], tokens, c.q_dim() + 2 * c.kv_dim(), e));
    if (!backend_.host_accessible()) {  // ToHost's float32 staging and host copies
      IG_RETURN_IF_ERROR(grow(ws_.mirror, tokens, c.q_dim() + c.kv_dim(), sizeof(float)));
      host_qk_.reserve(static_cast<size_t>(tokens * (c.q_dim() + c.kv_dim())));
      host_spec_q_.reserve(static_cast<size_t>(tokens * c.q_dim()));
    }
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

absl::Status Model::EnsureBuffer(std::unique_ptr<Buffer>& b, size_t bytes) {
  if (b != nullptr && b->size() >= bytes) return absl::OkStatus();
  b.reset();
  IG_ASSIGN_OR_RETURN(b, backend_.Allocate(std::max<size_t>(bytes, 64)));
  return absl::OkStatus();
}

absl::StatusOr<Model::HostRows> Model::ToHost(MatView m, std::vector<float>& host) {
  if (backend_.host_accessible()) return HostRows{m.As<const float>(), m.stride};
  const size_t count = static_cast<size_t>(m.rows * m.cols);
  IG_RETURN_IF_ERROR(EnsureBuffer(ws_.mirror, count * sizeof(float)));
  const MatView staging{ws_.mirror->data(), DType::kF32, m.rows, m.cols, m.cols};
  IG_RETURN_IF_ERROR(backend_.Copy(m, staging));  // converts the activations' type
  host.resize(count);
  IG_RETURN_IF_ERROR(backend_.CopyToHost(staging.data, host.data(), count * sizeof(float)));
  IG_RETURN_IF_ERROR(backend_.Synchronize());
  return HostRows{host.data(), m.cols};
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

absl::Status Model::Speculate(std::span<const ForwardChunk> batch, int next_layer, int64_t n,
                              MatView attention_input) {
  const ModelConfig& c = config_;
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView spec_in = Activations(*ws_.spec_in, n, c.hidden_size);
  const LayerWeights& L = weights_.layers[next_layer];
  int64_t row = 0;
  for (const ForwardChunk& chunk : batch) {
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    const SpeculationInput kind =
        chunk.policy != nullptr ? chunk.policy->speculation_input() : SpeculationInput::kNone;
    if (kind == SpeculationInput::kThisLayerNorm) {
      IG_RETURN_IF_ERROR(
          Norm(x.Rows(row, len), L.attn_norm, L.attn_norm_bias, spec_in.Rows(row, len)));
    } else {
      IG_RETURN_IF_ERROR(backend_.Copy(attention_input.Rows(row, len), spec_in.Rows(row, len)));
    }
    row += len;
  }
  MatView spec_qkv = SpeculatedQkv(next_layer, n);
  IG_RETURN_IF_ERROR(
      backend_.Linear(spec_in, L.qkv, L.qkv_bias ? &L.qkv_bias : nullptr, spec_qkv, false));
  if (c.architecture == Architecture::kLlama) {
    IG_RETURN_IF_ERROR(
        backend_.Rope(spec_qkv.Cols(0, c.q_dim()), c.num_heads, c.head_dim, c.rope.rotary_dim,
                      static_cast<const int32_t*>(ws_.positions->data()),
                      static_cast<const float*>(weights_.rope_inv_freq->data()), c.rope.layout));
  }
  return absl::OkStatus();
}

MatView Model::SpeculatedQkv(int layer, int64_t n) const {
  return Activations(*ws_.spec_qkv[layer % 2], n, config_.q_dim() + 2 * config_.kv_dim());
}

void Model::EverySlot(int64_t kv_heads, int64_t stored, std::vector<int32_t>& out) {
  out.resize(static_cast<size_t>(kv_heads * stored));
  for (int64_t g = 0; g < kv_heads; ++g) {
    std::iota(out.begin() + g * stored, out.begin() + (g + 1) * stored, 0);
  }
}

absl::Status Model::Prefetch(std::span<const ForwardChunk> batch, int next_layer, KvCache& cache,
                             int64_t n) {
  const ModelConfig& c = config_;
  const int64_t kv_heads = c.num_kv_heads;
  // The speculated queries of the layer, for policies that preselect from them.
  HostRows spec_q;
  if (speculating_ && next_layer > 0 && !cache.reads_in_place()) {
    IG_ASSIGN_OR_RETURN(spec_q,
                        ToHost(SpeculatedQkv(next_layer, n).Cols(0, c.q_dim()), host_spec_q_));
  }
  // Which decode chunks fetch, and how many rows they have stored (in order: cache calls).
  chunks_.resize(batch.size());
  int64_t row = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    ChunkWork& w = chunks_[b];
    w.row = row;
    row += len;
    w.stored = 0;
    w.fetch = false;
    w.candidates.all = true;  // every row unless a policy guesses fewer
    prefetched_[next_layer % 2][b].layer = -1;
    if (len != 1) continue;
    IG_ASSIGN_OR_RETURN(w.stored, cache.NumSlots(chunk.seq, next_layer));
    w.fetch = w.stored > 0;
  }
  // The policies' guesses, sequences in parallel. Every row without a policy, and where rows
  // are read in place (addresses cost nothing, so the exact selection made at the layer is
  // looked up among all of them).
  if (!cache.reads_in_place()) {
    IG_RETURN_IF_ERROR(ForEachPolicy(batch, [&](size_t b) {
      ChunkWork& w = chunks_[b];
      if (!w.fetch) return absl::OkStatus();
      KvSelectionPolicy* policy = batch[b].policy;
      SelectRequest request;
      request.seq = batch[b].seq;
      request.layer = next_layer;
      request.position = batch[b].start;
      request.kv.num_slots = w.stored;
      if (speculating_ && next_layer > 0 &&
          policy->speculation_input() != SpeculationInput::kNone) {
        request.speculated_q = spec_q.Row(w.row);
      }
      w.fetch = policy->Preselect(request, w.candidates);  // false: no guess, nothing fetched
      return absl::OkStatus();
    }));
  }
  // The batch's prefetches of this layer travel together.
  cache.BeginPrefetches();
  absl::Cleanup submit = [&cache] { cache.SubmitPrefetches(); };
  for (size_t b = 0; b < batch.size(); ++b) {
    ChunkWork& w = chunks_[b];
    if (!w.fetch) continue;
    Prefetched& pre = prefetched_[next_layer % 2][b];
    if (w.candidates.all) {  // dense: every stored row, in slot order
      EverySlot(kv_heads, w.stored, pre.slots);
      pre.count = w.stored;
    } else {
      pre.slots = std::move(w.candidates.indices);
      pre.count = w.candidates.count;
    }
    pre.dense = w.candidates.all;
    // One row per head is left free for the current token, which the step computes itself.
    IG_RETURN_IF_ERROR(cache.Prefetch(batch[b].seq, next_layer, pre.slots.data(), pre.count,
                                      /*extra_rows=*/1));
    pre.layer = next_layer;
  }
  return absl::OkStatus();
}

absl::Status Model::Attention(std::span<const ForwardChunk> batch, int layer, KvCache& cache,
                              int64_t n) {
  const ModelConfig& c = config_;
  MatView qkv = Activations(*ws_.qkv, n, c.q_dim() + 2 * c.kv_dim());
  MatView q = qkv.Cols(0, c.q_dim());
  MatView k = qkv.Cols(c.q_dim(), c.kv_dim());
  MatView v = qkv.Cols(c.q_dim() + c.kv_dim(), c.kv_dim());
  if (c.architecture == Architecture::kLlama) {
    const int32_t* positions = static_cast<const int32_t*>(ws_.positions->data());
    const float* inv_freq = static_cast<const float*>(weights_.rope_inv_freq->data());
    IG_RETURN_IF_ERROR(backend_.Rope(q, c.num_heads, c.head_dim, c.rope.rotary_dim, positions,
                                     inv_freq, c.rope.layout));
    IG_RETURN_IF_ERROR(backend_.Rope(k, c.num_kv_heads, c.head_dim, c.rope.rotary_dim, positions,
                                     inv_freq, c.rope.layout));
  }
  const int64_t kv_heads = c.num_kv_heads;
  host_slots_.resize(static_cast<size_t>(n * kv_heads));
  selections_.resize(batch.size());
  const bool resident = cache.resident();
  // Policies run on the host: they read this layer's queries and keys (and the speculated
  // queries) as host floats, copied out of the backend's memory where the host cannot read it.
  const bool host_memory = backend_.host_accessible();
  const bool any_policy = std::any_of(batch.begin(), batch.end(),
                                      [](const ForwardChunk& chunk) { return chunk.policy; });
  HostRows qk, spec_q;  // qk: the q and k columns of qkv, which are adjacent
  if (any_policy) {
    IG_ASSIGN_OR_RETURN(qk, ToHost(qkv.Cols(0, c.q_dim() + c.kv_dim()), host_qk_));
    if (speculating_ && layer > 0) {
      IG_ASSIGN_OR_RETURN(spec_q, ToHost(SpeculatedQkv(layer, n).Cols(0, c.q_dim()), host_spec_q_));
    }
  }

  // Pass 1: store every chunk's K/V (in order: cache calls).
  chunks_.resize(batch.size());
  int64_t row = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    KvSelectionPolicy* policy = chunk.policy;
    ChunkWork& w = chunks_[b];
    w.row = row;
    row += len;
    selections_[b].all = true;
    if (policy != nullptr && policy->needs_resident_kv() && (!resident || !host_memory)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "policy ", policy->Name(), " reads stored K rows itself and needs a resident KV cache",
          host_memory ? "" : " in host memory (the cpu backend)",
          "; infinigen, window and full run over any cache and backend"));
    }
    int32_t* slots = host_slots_.data() + w.row * kv_heads;
    IG_RETURN_IF_ERROR(
        cache.Append(chunk.seq, layer, chunk.start, k.Rows(w.row, len), v.Rows(w.row, len), slots));
    if (policy == nullptr) continue;
    w.kv = KvLayerView();  // the stored rows themselves only where the host can read them
    if (resident && host_memory) {
      IG_ASSIGN_OR_RETURN(w.kv, cache.Read(chunk.seq, layer));
    } else {
      IG_ASSIGN_OR_RETURN(w.kv.num_slots, cache.NumSlots(chunk.seq, layer));
    }
  }

  // The policies see the keys and choose the rows of each decode token, sequences in parallel.
  IG_RETURN_IF_ERROR(ForEachPolicy(batch, [&](size_t b) -> absl::Status {
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    KvSelectionPolicy* policy = chunk.policy;
    const ChunkWork& w = chunks_[b];
    const int32_t* slots = host_slots_.data() + w.row * kv_heads;
    LayerKeys keys{chunk.seq, layer,         chunk.start, len,   qk.Row(w.row) + c.q_dim(),
                   qk.stride, qk.Row(w.row), qk.stride,   slots, w.kv};
    IG_RETURN_IF_ERROR(policy->OnKeys(keys));
    if (len != 1) return absl::OkStatus();
    SelectRequest request;
    request.seq = chunk.seq;
    request.layer = layer;
    request.position = chunk.start;
    request.current_slots = slots;
    request.kv = w.kv;
    request.q = qk.Row(w.row);
    if (speculating_ && layer > 0 && policy->speculation_input() != SpeculationInput::kNone) {
      request.speculated_q = spec_q.Row(w.row);
    }
    Selection& selection = selections_[b];
    IG_RETURN_IF_ERROR(policy->Select(request, selection));
    if (!selection.all && (selection.count <= 0 || static_cast<int64_t>(selection.indices.size()) !=
                                                       selection.count * kv_heads)) {
      return absl::InternalError(
          absl::StrCat("policy ", policy->Name(), " returned a malformed selection"));
    }
    return absl::OkStatus();
  }));

  // A cache that is not resident starts fetching what the prefetch during the previous layer
  // did not bring, so that the fetches of later sequences overlap the attention of earlier ones
  // in pass 2.
  for (size_t b = 0; b < batch.size() && !resident; ++b) {
    const ForwardChunk& chunk = batch[b];
    const Selection& selection = selections_[b];
    const int32_t* slots = host_slots_.data() + chunks_[b].row * kv_heads;
    if (chunk.tokens.size() != 1 || MapPrefetched(b, layer, selection, slots)) continue;
    // Nothing prefetched, or the selection left the candidates: fetch exactly it now.
    if (selection.all) {  // dense: every stored row
      IG_ASSIGN_OR_RETURN(const int64_t stored, cache.NumSlots(chunk.seq, layer));
      EverySlot(kv_heads, stored, all_slots_);
      IG_RETURN_IF_ERROR(cache.Prefetch(chunk.seq, layer, all_slots_.data(), stored));
    } else {
      IG_RETURN_IF_ERROR(
          cache.Prefetch(chunk.seq, layer, selection.indices.data(), selection.count));
    }
  }

  // Pass 2: attention of every chunk over its rows.
  const AttentionShape shape{static_cast<int>(c.num_heads), static_cast<int>(c.num_kv_heads),
                             static_cast<int>(c.head_dim),
                             1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  MatView out = Activations(*ws_.attn, n, c.q_dim());
  row = 0;
  for (size_t b = 0; b < batch.size(); ++b) {
    const ForwardChunk& chunk = batch[b];
    const int64_t len = static_cast<int64_t>(chunk.tokens.size());
    const Selection& selection = selections_[b];
    if (len > 1 && chunk.start == 0 && !resident) {
      // A whole prompt in one chunk: its K/V are the activations; no need to read them back.
      const KvView kk{k.Rows(row, len).data, k.dtype, c.head_dim, k.stride};
      const KvView vv{v.Rows(row, len).data, v.dtype, c.head_dim, v.stride};
      IG_RETURN_IF_ERROR(
          backend_.AttentionCausal(q.Rows(row, len), kk, vv, 0, shape, out.Rows(row, len)));
      row += len;
      continue;
    }
    if (len > 1) {
      IG_ASSIGN_OR_RETURN(KvLayerView kv, cache.Read(chunk.seq, layer));
      if (kv.num_slots != chunk.start + len) {
        return absl::FailedPreconditionError(absl::StrCat(
            "prefill of sequence ", chunk.seq, " needs all its ", chunk.start + len,
            " tokens in the KV cache, which holds ", kv.num_slots, " (capacity too small)"));
      }
      IG_RETURN_IF_ERROR(backend_.AttentionCausal(q.Rows(row, len), kv.k, kv.v, chunk.start, shape,
                                                  out.Rows(row, len)));
    } else if (!resident && prefetched_[layer % 2][b].layer == layer) {
      // The rows prefetched during the previous layer, packed [num_kv_heads, count], then one
      // row per head for the current token, which this step computed itself.
      const Prefetched& pre = prefetched_[layer % 2][b];
      IG_ASSIGN_OR_RETURN(KvLayerView kv, cache.Fetch(chunk.seq, layer));
      const int64_t hd = c.head_dim;
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t dst = kv_heads * pre.count + g;
        const MatView k_row = k.Rows(row, 1).Cols(g * hd, hd);
        const MatView v_row = v.Rows(row, 1).Cols(g * hd, hd);
        if (kv.k.rows != nullptr) {  // rows read in place: point at the activations
          kv.k.rows[dst] = k_row.data;
          kv.v.rows[dst] = v_row.data;
          continue;
        }
        IG_RETURN_IF_ERROR(backend_.Copy(k_row, kv.k.Head(0, dst, 1, hd)));
        IG_RETURN_IF_ERROR(backend_.Copy(v_row, kv.v.Head(0, dst, 1, hd)));
      }
      cache.RecordFetch(chunk.seq, layer, selection.all ? nullptr : selection.indices.data(),
                        selection.all ? pre.count : selection.count);
      const size_t bytes = pre.map.size() * sizeof(int32_t);
      IG_RETURN_IF_ERROR(EnsureBuffer(ws_.indices, bytes));
      IG_RETURN_IF_ERROR(backend_.CopyToDevice(pre.map.data(), ws_.indices->data(), bytes));
      IG_RETURN_IF_ERROR(AttentionStep(
          chunk, layer, q.Rows(row, 1), kv, static_cast<const int32_t*>(ws_.indices->data()),
          static_cast<int64_t>(pre.map.size()) / kv_heads, selection, out.Rows(row, 1)));
    } else if (!resident) {
      // The rows fetched in pass 1 (all of them, or the selection), packed in selection order.
      IG_ASSIGN_OR_RETURN(KvLayerView kv, cache.Fetch(chunk.seq, layer));
      cache.RecordFetch(chunk.seq, layer, selection.all ? nullptr : selection.indices.data(),
                        selection.all ? kv.num_slots : selection.count);
      IG_RETURN_IF_ERROR(AttentionStep(chunk, layer, q.Rows(row, 1), kv, nullptr, kv.num_slots,
                                       selection, out.Rows(row, 1)));
    } else if (selection.all) {
      IG_ASSIGN_OR_RETURN(KvLayerView kv, cache.Read(chunk.seq, layer));
      IG_RETURN_IF_ERROR(AttentionStep(chunk, layer, q.Rows(row, 1), kv, nullptr, kv.num_slots,
                                       selection, out.Rows(row, 1)));
    } else {
      const int64_t rows = selection.count;
      cache.RecordFetch(chunk.seq, layer, selection.indices.data(), rows);
      IG_ASSIGN_OR_RETURN(KvLayerView kv, cache.Read(chunk.seq, layer));
      const size_t bytes = selection.indices.size() * sizeof(int32_t);
      IG_RETURN_IF_ERROR(EnsureBuffer(ws_.indices, bytes));
      IG_RETURN_IF_ERROR(
          backend_.CopyToDevice(selection.indices.data(), ws_.indices->data(), bytes));
      IG_RETURN_IF_ERROR(AttentionStep(chunk, layer, q.Rows(row, 1), kv,
                                       static_cast<const int32_t*>(ws_.indices->data()), rows,
                                       selection, out.Rows(row, 1)));
    }
    row += len;
  }
  return absl::OkStatus();
}

absl::Status Model::ForEachPolicy(std::span<const ForwardChunk> batch,
                                  const std::function<absl::Status(size_t)>& work) {
  policy_chunks_.clear();
  for (size_t b = 0; b < batch.size(); ++b) {
    if (batch[b].policy != nullptr) policy_chunks_.push_back(b);
  }
  const int64_t m = static_cast<int64_t>(policy_chunks_.size());
  // A policy keeps per-sequence state and is not thread-safe; separate policies are independent.
  bool distinct = m > 1;
  for (int64_t i = 0; i < m && distinct; ++i) {
    for (int64_t j = 0; j < i && distinct; ++j) {
      distinct = batch[policy_chunks_[i]].policy != batch[policy_chunks_[j]].policy;
    }
  }
  statuses_.assign(static_cast<size_t>(m), absl::OkStatus());
#pragma omp parallel for schedule(dynamic, 1) if (distinct)
  for (int64_t i = 0; i < m; ++i) statuses_[i] = work(policy_chunks_[i]);
  for (const absl::Status& st : statuses_) IG_RETURN_IF_ERROR(st);
  return absl::OkStatus();
}

bool Model::MapPrefetched(size_t b, int layer, const Selection& selection,
                          const int32_t* current_slots) {
  Prefetched& pre = prefetched_[layer % 2][b];
  if (pre.layer != layer) return false;
  const int64_t kv_heads = config_.num_kv_heads;
  // Row of the staging, relative to head g's first row, that holds the current token.
  auto current = [&](int64_t g) {
    return static_cast<int32_t>(kv_heads * pre.count + g - g * pre.count);
  };
  if (selection.all) {
    if (!pre.dense) return Miss(pre);
    // Every stored row in slot order, then the current token (its slot is the next one).
    const int64_t rows = pre.count + 1;
    pre.map.resize(static_cast<size_t>(kv_heads * rows));
    for (int64_t g = 0; g < kv_heads; ++g) {
      std::iota(pre.map.begin() + g * rows, pre.map.begin() + g * rows + pre.count, 0);
      pre.map[g * rows + pre.count] = current(g);
    }
    ++prefetch_hits_;
    return true;
  }
  const int64_t count = selection.count;
  pre.map.resize(static_cast<size_t>(kv_heads * count));
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int32_t* begin = pre.slots.data() + g * pre.count;
    const int32_t* end = begin + pre.count;
    for (int64_t j = 0; j < count; ++j) {
      const int32_t slot = selection.indices[g * count + j];
      int32_t at;
      if (slot == current_slots[g]) {
        at = current(g);
      } else if (pre.dense) {  // every stored slot, in slot order
        if (slot < 0 || slot >= pre.count) return Miss(pre);
        at = slot;
      } else {
        const int32_t* it = std::lower_bound(begin, end, slot);
        if (it == end || *it != slot) return Miss(pre);
        at = static_cast<int32_t>(it - begin);
      }
      pre.map[g * count + j] = at;
    }
  }
  ++prefetch_hits_;
  return true;
}

bool Model::Miss(Prefetched& pre) {
  pre.layer = -1;  // the caller fetches the exact selection
  ++prefetch_misses_;
  return false;
}

absl::Status Model::AttentionStep(const ForwardChunk& chunk, int layer, MatView q,
                                  const KvLayerView& kv, const int32_t* indices, int64_t rows,
                                  const Selection& selection, MatView out) {
  const ModelConfig& c = config_;
  const AttentionShape shape{static_cast<int>(c.num_heads), static_cast<int>(c.num_kv_heads),
                             static_cast<int>(c.head_dim),
                             1.0f / std::sqrt(static_cast<float>(c.head_dim))};
  KvSelectionPolicy* policy = chunk.policy;
  float* weights = nullptr;
  if (policy != nullptr && policy->wants_attention_weights()) {
    IG_RETURN_IF_ERROR(EnsureBuffer(ws_.weights, c.num_heads * rows * sizeof(float)));
    weights = static_cast<float*>(ws_.weights->data());
  }
  IG_RETURN_IF_ERROR(backend_.AttentionDecode(q, kv.k, kv.v, indices, rows, shape, out, weights));
  if (weights != nullptr) {
    host_weights_.resize(static_cast<size_t>(c.num_heads * rows));
    IG_RETURN_IF_ERROR(
        backend_.CopyToHost(weights, host_weights_.data(), host_weights_.size() * sizeof(float)));
    policy->OnAttentionWeights(chunk.seq, layer, selection, host_weights_.data(), rows);
  }
  return absl::OkStatus();
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

absl::Status Model::Logits(std::span<const ForwardChunk> batch, int64_t n, std::span<float> out) {
  const ModelConfig& c = config_;
  const int64_t rows = NumLogitRows(batch);
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView sel = Activations(*ws_.sel, rows, c.hidden_size);
  int64_t src = 0, dst = 0;
  for (const ForwardChunk& chunk : batch) {
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
  IG_RETURN_IF_ERROR(
      backend_.CopyToHost(logits.data, out.data(), static_cast<size_t>(rows * c.vocab_size) * 4));
  return backend_.Synchronize();
}

absl::Status Model::Forward(std::span<const ForwardChunk> batch, KvCache& cache,
                            std::span<float> logits) {
  const ModelConfig& c = config_;
  int64_t n = 0;
  for (const ForwardChunk& chunk : batch) n += static_cast<int64_t>(chunk.tokens.size());
  const int64_t rows = NumLogitRows(batch);
  if (static_cast<int64_t>(logits.size()) < rows * c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("logits buffer holds ", logits.size(),
                                                   " floats, ", rows * c.vocab_size, " needed"));
  }
  if (n == 0) return absl::OkStatus();

  host_ids_.resize(2 * n);
  host_positions_.resize(n);
  int64_t i = 0;
  for (const ForwardChunk& chunk : batch) {
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

  speculating_ = std::any_of(batch.begin(), batch.end(), [](const ForwardChunk& chunk) {
    return chunk.policy != nullptr && chunk.policy->speculation_input() != SpeculationInput::kNone;
  });
  for (auto& per_chunk : prefetched_) {
    per_chunk.resize(batch.size());
    for (Prefetched& p : per_chunk) p.layer = -1;
  }
  // Layer 0's rows start moving before the embedding; every later layer's during the one
  // before it.
  if (!cache.resident()) IG_RETURN_IF_ERROR(Prefetch(batch, 0, cache, n));
  IG_RETURN_IF_ERROR(Embed(n));
  MatView x = Activations(*ws_.x, n, c.hidden_size);
  MatView h = Activations(*ws_.h, n, c.hidden_size);
  MatView qkv = Activations(*ws_.qkv, n, c.q_dim() + 2 * c.kv_dim());
  MatView attn = Activations(*ws_.attn, n, c.q_dim());
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& L = weights_.layers[layer];
    MatView in = x;
    if (c.pre_norm) {
      IG_RETURN_IF_ERROR(Norm(x, L.attn_norm, L.attn_norm_bias, h));
      in = h;
    }
    // Speculation for the next layer from this layer's attention input; over a cache that is
    // not resident, its rows start moving now and arrive while this layer computes.
    if (layer + 1 < c.num_layers) {
      if (speculating_) IG_RETURN_IF_ERROR(Speculate(batch, layer + 1, n, in));
      if (!cache.resident()) IG_RETURN_IF_ERROR(Prefetch(batch, layer + 1, cache, n));
    }
    IG_RETURN_IF_ERROR(backend_.Linear(in, L.qkv, L.qkv_bias ? &L.qkv_bias : nullptr, qkv, false));
    IG_RETURN_IF_ERROR(Attention(batch, layer, cache, n));
    IG_RETURN_IF_ERROR(backend_.Linear(attn, L.o, L.o_bias ? &L.o_bias : nullptr, x, true));
    if (!c.pre_norm) IG_RETURN_IF_ERROR(Norm(x, L.attn_norm, L.attn_norm_bias, x));
    IG_RETURN_IF_ERROR(Mlp(L, n));
  }
  return Logits(batch, n, logits);
}

}  // namespace infinigen
