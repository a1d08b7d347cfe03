// KvSelectionPolicy: which stored tokens a decode step attends to, per layer and KV head. The
// model asks the policy at every layer of every decode token; `full` answers "all", InfiniGen
// speculates from the previous layer, and the baselines (H2O, window, oracle) are the paper's
// comparisons. Policies keep per-sequence state (partial key caches, accumulated scores) and
// see every key row the model stores, with its slot.
//
// Policies run on the host: the pointers below are host memory, float32 (the CPU backend's
// activations, or copies of them that the model makes on a backend the host cannot read).
// InfiniGen on a backend the host cannot read chooses in its memory instead (BackendChoice).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen {

// The rows one decode step reads at one layer.
struct Selection {
  bool all = true;               // every valid slot (dense attention)
  int64_t count = 0;             // rows per KV head when !all
  std::vector<int32_t> indices;  // [num_kv_heads, count] slots; each head's list includes the
                                 // current token's slot
};

// Keys the model just stored at one layer for one sequence (prefill chunk or decode token).
struct LayerKeys {
  SequenceId seq = 0;
  int layer = 0;
  int64_t start = 0;  // position of the first row
  int64_t count = 0;
  const float* k = nullptr;  // [count, num_kv_heads * head_dim], after RoPE
  int64_t k_stride = 0;
  const float* q = nullptr;  // [count, num_heads * head_dim], after RoPE (for scoring policies)
  int64_t q_stride = 0;
  const int32_t* slots = nullptr;  // [count, num_kv_heads]
  KvLayerView kv;                  // the layer's stored rows after the append
};

// What a decode step knows when it must choose rows for `layer`.
struct SelectRequest {
  SequenceId seq = 0;
  int layer = 0;
  int64_t position = 0;                    // the current token's position
  const int32_t* current_slots = nullptr;  // [num_kv_heads]
  KvLayerView kv;                          // valid slots of the layer (current token included)
  const float* q = nullptr;                // this layer's query [num_heads * head_dim], after RoPE
  // This layer's partial query q~ [num_heads, partial_dim] speculated from the previous layer's
  // attention input (Model::SpeculatePartialQuery: after RoPE, on each KV head's A[:, P]), when
  // the policy speculates this layer; else null.
  const float* speculated_q = nullptr;
};

// A choice made in backend memory (a policy that chooses_on_backend()): what DecodeStep asks.
struct BackendChoice {
  SequenceId seq = 0;
  int layer = 0;
  // The rows to choose among: the stored ones, for the prefetch during the previous layer
  // (`prefetch`: the candidates, with the margin), or those and the current token last (the
  // layer's own choice, which always keeps the current token).
  int64_t rows = 0;
  bool prefetch = false;
  MatView speculated_q;  // [1, num_heads * partial_dim] in backend memory; null data: none
  // Outputs in backend memory: the rows of KV head g at indices + g * index_capacity
  // (BackendChoiceCapacity(rows) of them at most), ascending, and their number in *count.
  int32_t* indices = nullptr;
  int64_t index_capacity = 0;
  int32_t* count = nullptr;
};
// What ChooseOnBackend did: nothing (no guess: nothing to prefetch), every row (no launch), or
// launched a choice whose outputs are in backend memory.
enum class BackendChoiceResult { kNone, kAll, kLaunched };

// Which attention input the speculation for layer i starts from (INFINIGEN.md, decode step 1).
enum class SpeculationInput {
  kNone,           // the policy does not speculate
  kPreviousNorm,   // layer i-1's normalized attention input (the paper's choice)
  kThisLayerNorm,  // layer i-1's residual input normalized with layer i's norm weights
  kActualQuery     // no speculation: layer i's own query (analysis only: it cannot prefetch)
};

class KvSelectionPolicy {
 public:
  virtual ~KvSelectionPolicy() = default;
  virtual std::string Name() const = 0;

  virtual SpeculationInput speculation_input() const { return SpeculationInput::kNone; }
  // Whether the policy reads a speculated query for `layer` (a speculating policy's dense
  // layers need none).
  virtual bool SpeculatesFor(int layer) const {
    return speculation_input() != SpeculationInput::kNone;
  }
  // Whether the model should report attention probabilities of decode steps (H2O).
  virtual bool wants_attention_weights() const { return false; }
  // Whether the policy reads stored K rows itself (H2O's prefill scores, the oracle's exact
  // scores), so it cannot run over a cache that is not resident (the KV store) nor over one in
  // memory the host cannot read (a GPU). The others see KvLayerView::num_slots only there.
  virtual bool needs_resident_kv() const { return false; }

  // `seq` will hold up to `capacity_tokens` tokens: per-sequence state is sized for them here,
  // so that its decode steps allocate nothing (the engine calls it when it admits the sequence;
  // without it state grows as rows arrive).
  virtual void Open(SequenceId seq, int64_t capacity_tokens) {}
  // Backend memory the state of a sequence opened with `capacity_tokens` takes at most, until
  // Release (what admission reserves for it); 0 where the policy keeps nothing there.
  virtual size_t BackendBytesFor(int64_t capacity_tokens) const { return 0; }
  // Host memory the same takes at most (a host policy's partial keys, positions, scratch).
  virtual size_t HostBytesFor(int64_t capacity_tokens) const { return 0; }
  // Every K row the model stores, prefill and decode, in order.
  virtual absl::Status OnKeys(const LayerKeys& keys) { return absl::OkStatus(); }
  // Rows for one decode token at one layer.
  virtual absl::Status Select(const SelectRequest& request, Selection& out) = 0;
  // Candidate rows to prefetch for `request.layer` while the previous layer still computes:
  // request.kv.num_slots counts the stored rows only (the current token's key does not exist
  // yet; current_slots is null; speculated_q is null where nothing was speculated). A superset
  // guess of what Select will choose at the layer, or out.all for every stored row (a layer it
  // attends densely); the model fetches again if Select picks a row outside it. False: no
  // guess (nothing prefetched).
  virtual bool Preselect(const SelectRequest& request, Selection& out) { return false; }
  // Attention probabilities of that step: [num_heads, rows], rows in the selection's order
  // (all valid slots when the selection was `all`).
  virtual void OnAttentionWeights(SequenceId seq, int layer, const Selection& selection,
                                  const float* weights, int64_t rows) {}
  // Choosing in backend memory (InfiniGen on a GPU): the policy keeps what it scores there
  // (partial keys) and chooses rows there, so that the host reads back only the chosen rows.
  // DecodeStep then calls OnBackendKeys and ChooseOnBackend instead of OnKeys, Preselect and
  // Select. Only over caches whose slots are positions (each new row in the next slot).
  virtual bool chooses_on_backend() const { return false; }
  // The most rows per KV head a choice over `rows` rows takes (its index capacity).
  virtual int64_t BackendChoiceCapacity(int64_t rows) const { return rows; }
  // Keys (after RoPE, backend memory, [count, num_kv_heads * head_dim]) of positions
  // first_position .. of `layer`.
  virtual absl::Status OnBackendKeys(SequenceId seq, int layer, MatView k, int64_t first_position) {
    return absl::UnimplementedError("this policy does not choose on the backend");
  }
  virtual absl::StatusOr<BackendChoiceResult> ChooseOnBackend(const BackendChoice& choice) {
    return absl::UnimplementedError("this policy does not choose on the backend");
  }
  // The sequence is finished; drop its state.
  virtual void Release(SequenceId seq) {}
};

}  // namespace infinigen
