#include "gpu_worker/infinigen/metered_policy.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "gpu_worker/infinigen/selection_util.h"

namespace infinigen {

MeteredPolicy::MeteredPolicy(KvSelectionPolicy& inner, const ModelConfig& model, int dense_layers,
                             bool measure_recall)
    : inner_(inner), model_(model), dense_layers_(dense_layers), measure_recall_(measure_recall) {}

int64_t MeteredPolicy::RowsMoved(const SelectRequest& r, const Selection& out) {
  const int64_t stored = r.kv.num_slots - 1;  // the current token is computed, not moved
  const int64_t selected = out.all ? stored : out.count - 1;
  if (!preselected_) return selected;  // nothing guessed: the exact selection is fetched
  if (candidates_.all) return stored;
  const int64_t kv_heads = model_.num_kv_heads;
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int32_t* begin = candidates_.indices.data() + g * candidates_.count;
    const int32_t* end = begin + candidates_.count;
    for (int64_t j = 0; !out.all && j < out.count; ++j) {
      const int32_t slot = out.indices[g * out.count + j];
      if (slot == r.current_slots[g] || std::binary_search(begin, end, slot)) continue;
      ++meter_.prefetch_misses;  // fetched again: the candidates and then the selection
      return candidates_.count + selected;
    }
    if (out.all) {
      ++meter_.prefetch_misses;
      return candidates_.count + selected;
    }
  }
  return candidates_.count;
}

absl::Status MeteredPolicy::Select(const SelectRequest& r, Selection& out) {
  // What DecodeStep over a streamed cache would have prefetched during the previous layer: the
  // same speculation over the rows stored before this token.
  SelectRequest pre = r;
  pre.kv = KvLayerView();
  pre.kv.num_slots = r.kv.num_slots - 1;
  pre.current_slots = nullptr;
  preselected_ = pre.kv.num_slots > 0 && inner_.Preselect(pre, candidates_);
  absl::Status st = inner_.Select(r, out);
  if (!st.ok()) return st;
  const int64_t kv_heads = model_.num_kv_heads, n = r.kv.num_slots;
  const int64_t read = (out.all ? n : out.count) * kv_heads;
  const int64_t moved = RowsMoved(r, out) * kv_heads;
  meter_.rows_read += read;
  meter_.rows_full += n * kv_heads;
  meter_.rows_moved += moved;
  if (r.layer < dense_layers_) return st;
  meter_.sparse_rows_read += read;
  meter_.sparse_rows_full += n * kv_heads;
  meter_.sparse_rows_moved += moved;
  if (!measure_recall_) return st;
  // Per head: attention mass on the selected rows / mass on the k heaviest rows.
  const int heads = static_cast<int>(model_.num_heads);
  const int group = heads / static_cast<int>(kv_heads);
  ExactScores(r.q, r.kv, heads, static_cast<int>(kv_heads), static_cast<int>(model_.head_dim),
              1.0f / std::sqrt(static_cast<float>(model_.head_dim)), scores_);
  double recall = 0;
  for (int h = 0; h < heads; ++h) {
    float* s = scores_.data() + static_cast<size_t>(h) * n;
    const float mx = *std::max_element(s, s + n);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
    for (int64_t j = 0; j < n; ++j) s[j] = static_cast<float>(s[j] / sum);
    const int64_t k = out.all ? n : out.count;
    double selected = 0;
    if (out.all) {
      selected = 1.0;
    } else {
      const int32_t* idx = out.indices.data() + (h / group) * k;
      for (int64_t j = 0; j < k; ++j) selected += s[idx[j]];
    }
    sorted_.assign(s, s + n);
    std::nth_element(sorted_.begin(), sorted_.begin() + (k - 1), sorted_.end(),
                     std::greater<float>());
    double best = 0;
    for (int64_t j = 0; j < k; ++j) best += sorted_[j];
    recall += best > 0 ? std::min(1.0, selected / best) : 1.0;
  }
  meter_.recall_sum += recall / heads;
  ++meter_.recall_steps;
  return st;
}

}  // namespace infinigen
