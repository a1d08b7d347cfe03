#include "gpu_worker/kv/row_reuse.h"

#include <algorithm>

namespace infinigen {

ReusedRows::ReusedRows(int num_layers, int num_kv_heads, int64_t rows)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), rows_(std::max<int64_t>(rows, 0)) {
  heads_.resize(static_cast<size_t>(num_layers) * num_kv_heads);
  for (Head& h : heads_) {
    h.slots.reserve(rows_);
    h.rows.reserve(rows_);
    h.free.reserve(rows_);
  }
  next_slots_.reserve(rows_);
  next_rows_.reserve(rows_);
  ForgetAll();
}

size_t ReusedRows::BytesFor(int num_layers, int num_kv_heads, int64_t rows) {
  const size_t per_head = 3 * static_cast<size_t>(std::max<int64_t>(rows, 0)) * sizeof(int32_t);
  return static_cast<size_t>(num_layers) * num_kv_heads * per_head + 2 * per_head / 3;
}

size_t ReusedRows::PlanBytesFor(int num_kv_heads, int64_t rows) {
  const size_t n =
      static_cast<size_t>(num_kv_heads) * static_cast<size_t>(std::max<int64_t>(rows, 0));
  return (3 * n + static_cast<size_t>(num_kv_heads)) * sizeof(int32_t);
}

void ReusedRows::Forget(int layer) {
  if (layer < 0 || layer >= num_layers_) return;
  for (int g = 0; g < num_kv_heads_; ++g) {
    Head& h = At(layer, g);
    h.slots.clear();
    h.rows.clear();
    h.free.clear();
    // Popped from the back: rows 0, 1, ... are taken first.
    for (int64_t r = rows_ - 1; r >= 0; --r) h.free.push_back(static_cast<int32_t>(r));
  }
}

void ReusedRows::ForgetAll() {
  for (int l = 0; l < num_layers_; ++l) Forget(l);
}

bool ReusedRows::Place(int layer, const int32_t* slots, int64_t count, Plan& plan) {
  if (layer < 0 || layer >= num_layers_ || count < 0 || count > rows_) return false;
  for (int g = 0; g < num_kv_heads_; ++g) {
    const int32_t* list = slots + g * count;
    if (count > 0 && list[0] < 0) return false;
    for (int64_t j = 1; j < count; ++j) {
      if (list[j] <= list[j - 1]) return false;
    }
  }
  const size_t n = static_cast<size_t>(num_kv_heads_ * count);
  plan.count = count;
  plan.positions.resize(n);
  plan.moves.resize(2 * n + static_cast<size_t>(num_kv_heads_));
  plan.misses = plan.most_misses = 0;
  int32_t* miss_slots = plan.moves.data();
  int32_t* miss_rows = miss_slots + n;
  int32_t* miss_counts = miss_rows + n;
  for (int g = 0; g < num_kv_heads_; ++g) {
    Head& h = At(layer, g);
    const int32_t* list = slots + g * count;
    int32_t* at = plan.positions.data() + g * count;
    // One walk through both ascending lists: the rows listed again stay where they are, the
    // others held are freed.
    size_t i = 0;
    for (int64_t j = 0; j < count; ++j) {
      while (i < h.slots.size() && h.slots[i] < list[j]) h.free.push_back(h.rows[i++]);
      if (i < h.slots.size() && h.slots[i] == list[j]) {
        at[j] = h.rows[i++];
      } else {
        at[j] = -1;
      }
    }
    while (i < h.slots.size()) h.free.push_back(h.rows[i++]);
    // The misses into freed rows (there are enough: rows - hits >= count - hits).
    int64_t m = 0;
    next_slots_.clear();
    next_rows_.clear();
    for (int64_t j = 0; j < count; ++j) {
      if (at[j] < 0) {
        at[j] = h.free.back();
        h.free.pop_back();
        miss_slots[g * count + m] = list[j];
        miss_rows[g * count + m] = at[j];
        ++m;
      }
      next_slots_.push_back(list[j]);
      next_rows_.push_back(at[j]);
    }
    h.slots.swap(next_slots_);
    h.rows.swap(next_rows_);
    miss_counts[g] = static_cast<int32_t>(m);
    plan.misses += m;
    plan.most_misses = std::max(plan.most_misses, m);
  }
  return true;
}

}  // namespace infinigen
