#include "gpu_worker/infinigen/selection_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <numeric>

#include "common/dtype.h"

namespace infinigen {

void SlotPositions::Reserve(SequenceId seq, int num_layers, int num_kv_heads, int64_t capacity) {
  auto& layers = seqs_[seq];
  if (static_cast<int>(layers.size()) < num_layers) layers.resize(num_layers);
  for (auto& heads : layers) {
    if (static_cast<int>(heads.size()) < num_kv_heads) heads.resize(num_kv_heads);
    for (auto& pos : heads) pos.reserve(static_cast<size_t>(capacity));
  }
}

void SlotPositions::Record(const LayerKeys& keys, int num_kv_heads) {
  auto& layers = seqs_[keys.seq];
  if (static_cast<int>(layers.size()) <= keys.layer) layers.resize(keys.layer + 1);
  auto& heads = layers[keys.layer];
  if (static_cast<int>(heads.size()) < num_kv_heads) heads.resize(num_kv_heads);
  for (int64_t t = 0; t < keys.count; ++t) {
    for (int g = 0; g < num_kv_heads; ++g) {
      const int32_t slot = keys.slots[t * num_kv_heads + g];
      auto& pos = heads[g];
      if (static_cast<int32_t>(pos.size()) <= slot) pos.resize(slot + 1, -1);
      pos[slot] = keys.start + t;
    }
  }
}

const std::vector<int64_t>& SlotPositions::Of(SequenceId seq, int layer, int head) const {
  static const std::vector<int64_t> kEmpty;
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || layer >= static_cast<int>(it->second.size()) ||
      head >= static_cast<int>(it->second[layer].size())) {
    return kEmpty;
  }
  return it->second[layer][head];
}

void TopK(const float* scores, int64_t n, int64_t k, const std::vector<int32_t>& forced,
          std::vector<int32_t>& out) {
  const size_t begin = out.size();
  out.resize(begin + static_cast<size_t>(std::max<int64_t>(std::min(k, n), 0)));
  const int64_t written = TopK(scores, n, k, forced, out.data() + begin);
  out.resize(begin + static_cast<size_t>(written));
}

void ExactScores(const float* q, const KvLayerView& kv, int num_heads, int num_kv_heads,
                 int head_dim, float scale, std::vector<float>& out) {
  const int64_t n = kv.num_slots;
  out.resize(static_cast<size_t>(num_heads) * n);
  const int group = num_heads / num_kv_heads;
  const bool bf16 = kv.k.dtype == DType::kBF16;  // else float32
  std::vector<float> row(static_cast<size_t>(head_dim));
  for (int h = 0; h < num_heads; ++h) {
    const float* qh = q + static_cast<size_t>(h) * head_dim;
    const int64_t first = (h / group) * kv.k.head_stride;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = first + j * kv.k.row_stride;
      const float* kr = static_cast<const float*>(kv.k.data) + at;
      if (bf16) {
        const uint16_t* kb = static_cast<const uint16_t*>(kv.k.data) + at;
        for (int d = 0; d < head_dim; ++d) row[d] = Bf16ToFloat(kb[d]);
        kr = row.data();
      }
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
      out[static_cast<size_t>(h) * n + j] = dot * scale;
    }
  }
}

}  // namespace infinigen
