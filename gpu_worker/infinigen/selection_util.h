// Pieces shared by the selection policies: which token sits in which slot, per-KV-head top-k
// without a full sort, and the group aggregation of GQA (the last two from kernels/cpu/).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gpu_worker/kv/kv_selection.h"
#include "kernels/cpu/selection.h"

namespace infinigen {

// Position of the token in every slot, per (sequence, layer, KV head), kept from OnKeys.
class SlotPositions {
 public:
  // Room for `capacity` slots of every (layer, head) of `seq`, so that Record allocates nothing.
  void Reserve(SequenceId seq, int num_layers, int num_kv_heads, int64_t capacity);
  void Record(const LayerKeys& keys, int num_kv_heads);
  // [slot] -> position for one head; empty if unknown.
  const std::vector<int64_t>& Of(SequenceId seq, int layer, int head) const;
  void Release(SequenceId seq) { seqs_.erase(seq); }

 private:
  // seq -> [layer][head][slot]
  absl::flat_hash_map<SequenceId, std::vector<std::vector<std::vector<int64_t>>>> seqs_;
};

// Top-k per KV head and the GQA attention mass (kernels/cpu/selection.h).
using cpu::GroupAttentionMass;
using cpu::TopK;
// cpu::TopK, appended to `out`.
void TopK(const float* scores, int64_t n, int64_t k, const std::vector<int32_t>& forced,
          std::vector<int32_t>& out);

// Exact attention logits q_h · k_j * scale of every head over rows [0, n) of the layer.
// q: [num_heads * head_dim]; out: [num_heads, n].
void ExactScores(const float* q, const KvLayerView& kv, int num_heads, int num_kv_heads,
                 int head_dim, float scale, std::vector<float>& out);

}  // namespace infinigen
