#include "gpu_worker/infinigen/selection_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace infinigen {

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
  std::vector<uint8_t> taken(n, 0);
  for (int32_t f : forced) {
    if (f >= 0 && f < n && !taken[f] && static_cast<int64_t>(out.size() - begin) < k) {
      taken[f] = 1;
      out.push_back(f);
    }
  }
  std::vector<int32_t> rest;
  rest.reserve(n);
  for (int32_t j = 0; j < n; ++j) {
    if (!taken[j]) rest.push_back(j);
  }
  const int64_t need = std::min<int64_t>(k - static_cast<int64_t>(out.size() - begin), rest.size());
  if (need > 0) {
    auto better = [&](int32_t a, int32_t b) {
      return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
    };
    std::nth_element(rest.begin(), rest.begin() + (need - 1), rest.end(), better);
    out.insert(out.end(), rest.begin(), rest.begin() + need);
  }
  std::sort(out.begin() + static_cast<std::ptrdiff_t>(begin), out.end());
}

void GroupAttentionMass(const float* scores, int num_heads, int num_kv_heads, int64_t n,
                        std::vector<float>& out) {
  out.assign(static_cast<size_t>(num_kv_heads) * n, 0.0f);
  const int group = num_heads / num_kv_heads;
  for (int h = 0; h < num_heads; ++h) {
    const float* s = scores + static_cast<size_t>(h) * n;
    const float mx = *std::max_element(s, s + n);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(s[j] - mx);
    float* o = out.data() + static_cast<size_t>(h / group) * n;
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) o[j] += std::exp(s[j] - mx) * inv;
  }
}

void ExactScores(const float* q, const KvLayerView& kv, int num_heads, int num_kv_heads,
                 int head_dim, float scale, std::vector<float>& out) {
  const int64_t n = kv.num_slots;
  out.resize(static_cast<size_t>(num_heads) * n);
  const int group = num_heads / num_kv_heads;
  const float* k = static_cast<const float*>(kv.k.data);
  for (int h = 0; h < num_heads; ++h) {
    const float* qh = q + static_cast<size_t>(h) * head_dim;
    const float* kh = k + (h / group) * kv.k.head_stride;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = kh + j * kv.k.row_stride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
      out[static_cast<size_t>(h) * n + j] = dot * scale;
    }
  }
}

}  // namespace infinigen
