#include "gpu_worker/kv/kv_pool.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace infinigen {

int64_t KvPoolConfig::CapacityFor(int64_t tokens) const {
  const int64_t capacity = capacity_tokens > 0
                               ? capacity_tokens
                               : static_cast<int64_t>(std::ceil(capacity_fraction * tokens));
  return std::max<int64_t>(capacity, 1);
}

PooledSlots::PooledSlots(int num_layers, int num_kv_heads, int64_t capacity,
                         EvictionPolicy eviction)
    : capacity_(0), eviction_(eviction) {
  tables_.assign(num_layers, std::vector<SlotTable>(num_kv_heads));
  Grow(capacity);
}

void PooledSlots::Grow(int64_t capacity) {
  if (capacity <= capacity_) return;
  capacity_ = capacity;
  for (auto& layer : tables_) {
    for (SlotTable& t : layer) t.Resize(capacity);
  }
}

bool PooledSlots::Fits(int layer, int64_t n) const { return rows(layer) + n <= capacity_; }

absl::StatusOr<int64_t> PooledSlots::Place(int layer, int64_t start, int64_t n,
                                           int32_t* slots_out) {
  std::vector<SlotTable>& heads = tables_[layer];
  if (n > 1 && !Fits(layer, n)) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefill of ", n, " tokens does not fit the sequence's KV pool capacity of ",
                     capacity_, " tokens (", rows(layer), " stored)"));
  }
  if (layer == 0) ++step_;
  int64_t evicted_tokens = 0;
  const int64_t num_heads = static_cast<int64_t>(heads.size());
  for (int64_t t = 0; t < n; ++t) {
    bool evicted = false;
    for (int64_t g = 0; g < num_heads; ++g) {
      slots_out[t * num_heads + g] = heads[g].Place(start + t, step_, eviction_, &evicted);
    }
    evicted_tokens += evicted;
  }
  return evicted_tokens;
}

void PooledSlots::Fetched(int layer, const int32_t* slots, int64_t count) {
  std::vector<SlotTable>& heads = tables_[layer];
  for (size_t g = 0; g < heads.size(); ++g) {
    for (int64_t j = 0; j < count; ++j) heads[g].Fetched(slots[g * count + j], step_);
  }
}

}  // namespace infinigen
