// The decoder-only transformer of the Llama family and OPT, written once against Backend.
// Forward() runs a ragged batch: each chunk is some new tokens of one sequence (a whole prompt,
// a prefill chunk, or one decode token), so prefill and decode share one code path and
// continuous batching can mix them in a step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu_worker/backend/backend.h"
#include "gpu_worker/engine/kv_cache.h"
#include "gpu_worker/engine/kv_selection.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/config.h"
#include "gpu_worker/model/weights.h"

namespace infinigen {

struct ForwardChunk {
  SequenceId seq = 0;
  int64_t start = 0;                // tokens of `seq` already in the cache (= first position)
  std::span<const int32_t> tokens;  // the new tokens
  bool all_logits = false;          // logits of every new token, else of the last one only
  // Which rows decode steps of this sequence attend to; null = all (dense).
  KvSelectionPolicy* policy = nullptr;
};

class Model {
 public:
  // Loads every weight of `ckpt` onto `backend`, which must outlive the model.
  static absl::StatusOr<std::unique_ptr<Model>> Load(const Checkpoint& ckpt, Backend& backend);

  const ModelConfig& config() const { return config_; }
  Backend& backend() const { return backend_; }
  // The K/V layout a cache for this model must have.
  KvCacheShape kv_shape() const;

  // Decode steps whose selection was among the rows prefetched during the previous layer
  // (hits), and those that had to fetch again (misses).
  int64_t prefetch_hits() const { return prefetch_hits_; }
  int64_t prefetch_misses() const { return prefetch_misses_; }

  // Logit rows that Forward writes for `batch`: per chunk, all its tokens or its last one.
  static int64_t NumLogitRows(std::span<const ForwardChunk> batch);

  // Runs `batch`, appending each chunk's K/V to `cache` (the sequences must be open there), and
  // writes float32 logits [NumLogitRows(batch), vocab_size] to host memory `logits`, chunk by
  // chunk in order. INVALID_ARGUMENT for out-of-range token ids or positions.
  absl::Status Forward(std::span<const ForwardChunk> batch, KvCache& cache,
                       std::span<float> logits);

 private:
  Model(const ModelConfig& config, Backend& backend, ModelWeights weights);

  // Scratch activations, sized for a number of tokens and logit rows; grows only.
  struct Workspace {
    int64_t max_tokens = 0;
    int64_t max_logit_rows = 0;
    std::unique_ptr<Buffer> ids, positions, x, h, qkv, attn, mlp, act, sel, sel_proj, logits;
    // Speculation (policies that predict layer i from layer i-1): the speculation input and
    // the speculated projection of layer i, in spec_qkv[i % 2] (layer i-1 writes layer i's
    // while layer i-1's own is still in use).
    std::unique_ptr<Buffer> spec_in, spec_qkv[2];
    // Decode selection: row indices in device memory and attention weights, sized on demand.
    std::unique_ptr<Buffer> indices, weights;
    // Float32 staging of activations the host policies read, on backends the host cannot read
    // (sized with the others in Reserve, so that no decode step allocates it).
    std::unique_ptr<Buffer> mirror;
  };
  absl::Status Reserve(int64_t tokens, int64_t logit_rows);
  MatView Activations(Buffer& b, int64_t rows, int64_t cols) const;

  absl::Status Embed(int64_t num_tokens);
  // The speculated queries of `next_layer` for the rows whose policy asks for them, from the
  // current layer's attention input (or its residual input under the next layer's norm).
  absl::Status Speculate(std::span<const ForwardChunk> batch, int next_layer, int64_t num_tokens,
                         MatView attention_input);
  MatView SpeculatedQkv(int layer, int64_t num_tokens) const;
  // Starts fetching, from a cache that is not resident, the rows of `next_layer` that each
  // decode token will read: the candidates its policy preselects from the speculation
  // (INFINIGEN.md decode step 6), or every stored row where it attends densely (no policy, a
  // dense layer), so that a full fetch overlaps the layer before too.
  absl::Status Prefetch(std::span<const ForwardChunk> batch, int next_layer, KvCache& cache,
                        int64_t num_tokens);
  // Slots 0 .. stored-1 for each of `kv_heads` heads ([kv_heads, stored]): a dense read.
  static void EverySlot(int64_t kv_heads, int64_t stored, std::vector<int32_t>& out);
  absl::Status EnsureBuffer(std::unique_ptr<Buffer>& b, size_t bytes);
  // Float32 rows on the host, for the selection policies (which run there).
  struct HostRows {
    const float* data = nullptr;
    int64_t stride = 0;
    const float* Row(int64_t r) const { return data + r * stride; }
  };
  // `m` itself where the backend's memory is host floats; else a float32 copy of it in `host`
  // (converted on the device, then copied out; waits for the backend).
  absl::StatusOr<HostRows> ToHost(MatView m, std::vector<float>& host);
  absl::Status Norm(MatView x, const Weight& w, const Weight& b, MatView out);
  absl::Status Attention(std::span<const ForwardChunk> batch, int layer, KvCache& cache,
                         int64_t num_tokens);
  // One decode token's attention over `rows` rows of `kv` (listed by device `indices`, or the
  // first `rows` when null); hands the attention weights to policies that want them.
  // Whether every row of `selection` (chunk b's, at the layer prefetched for it) is among the
  // prefetched candidates or is the current token (a selection of all rows: whether every row
  // was prefetched); fills the chunk's row map if so.
  bool MapPrefetched(size_t b, int layer, const Selection& selection, const int32_t* current_slots);
  // Runs work(b) for every chunk b whose policy is set and returns the first error: on several
  // threads (OpenMP) when those chunks' policies are distinct objects, in order otherwise.
  // `work` calls only its chunk's policy and writes only that chunk's state.
  absl::Status ForEachPolicy(std::span<const ForwardChunk> batch,
                             const std::function<absl::Status(size_t)>& work);
  struct Prefetched;
  bool Miss(Prefetched& pre);
  absl::Status AttentionStep(const ForwardChunk& chunk, int layer, MatView q, const KvLayerView& kv,
                             const int32_t* indices, int64_t rows, const Selection& selection,
                             MatView out);
  absl::Status Mlp(const LayerWeights& L, int64_t num_tokens);
  absl::Status Logits(std::span<const ForwardChunk> batch, int64_t num_tokens,
                      std::span<float> out);

  ModelConfig config_;
  Backend& backend_;
  ModelWeights weights_;
  Workspace ws_;
  std::vector<int32_t> host_ids_, host_positions_;
  std::vector<int32_t> host_slots_;  // [tokens, num_kv_heads] slots from the last Append
  std::vector<float> host_weights_;
  std::vector<float> host_qk_, host_spec_q_;  // ToHost copies (backends the host cannot read)
  std::vector<Selection> selections_;  // per chunk of the current batch, at the current layer
  std::vector<int32_t> all_slots_;     // every slot, for dense reads of a non-resident cache
  // Per layer parity and chunk: the candidate rows prefetched for a layer (-1: none),
  // [num_kv_heads, count]; layer i's are in use while layer i + 1's are being fetched.
  struct Prefetched {
    int layer = -1;
    int64_t count = 0;
    bool dense = false;  // every stored row (slots 0, 1, ...)
    std::vector<int32_t> slots;
    std::vector<int32_t> map;  // the selection's rows as rows of the prefetched staging
  };
  std::vector<Prefetched> prefetched_[2];
  // Per chunk of the current batch, what the policy work of a layer (run in parallel) needs.
  struct ChunkWork {
    int64_t row = 0;     // the chunk's first row of the batch's activations
    KvLayerView kv;      // the layer's stored rows as its policy may see them
    int64_t stored = 0;  // rows stored before this step (prefetch)
    bool fetch = false;  // the prefetch fetches for it
    Selection candidates;
  };
  std::vector<ChunkWork> chunks_;
  std::vector<size_t> policy_chunks_;
  std::vector<absl::Status> statuses_;
  int64_t prefetch_hits_ = 0, prefetch_misses_ = 0;
  bool speculating_ = false;  // some chunk of the current batch speculates
};

}  // namespace infinigen
