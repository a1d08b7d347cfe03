// The KV pool of INFINIGEN.md: a sequence keeps at most `capacity` tokens per (layer, KV head);
// a decode token that finds its head full takes a victim's slot (slot_table.h's policies). This
// is the bookkeeping both pooled caches share: the worker's resident KvPoolCache, and the
// StoreKvCache, which sends the slots it chooses with each append (the store stores rows where
// told), so that the partial key cache a policy keeps by slot stays aligned with the store.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kv_store/slot_table.h"

namespace infinigen {

struct KvPoolConfig {
  // Capacity of a sequence: capacity_tokens when > 0, else ceil(capacity_fraction x the
  // capacity given to Open (its prompt plus most new tokens)).
  double capacity_fraction = 1.0;
  int64_t capacity_tokens = 0;
  EvictionPolicy eviction = EvictionPolicy::kCounter;

  // The capacity of a sequence opened for at most `tokens` tokens (at least 1).
  int64_t CapacityFor(int64_t tokens) const;
};

// One sequence's slot tables, [layer][KV head]. Every head of a layer gets every token, so their
// sizes are equal.
class PooledSlots {
 public:
  PooledSlots(int num_layers, int num_kv_heads, int64_t capacity, EvictionPolicy eviction);

  int64_t capacity() const { return capacity_; }
  // Raises the capacity (a prompt longer than the sequence's share is kept whole).
  void Grow(int64_t capacity);
  // Whether `n` more tokens fit in `layer` without evicting.
  bool Fits(int layer, int64_t n) const;
  // Places tokens [start, start + n) of `layer`; slots_out ([n, num_kv_heads]) gets their slots.
  // A prompt chunk (n > 1) must fit (FAILED_PRECONDITION): prefill attends by position, which
  // evicted slots no longer follow. Returns the tokens evicted (counted once, not per head).
  absl::StatusOr<int64_t> Place(int layer, int64_t start, int64_t n, int32_t* slots_out);
  // A step attended `count` slots of each head (slots: [num_kv_heads, count]).
  void Fetched(int layer, const int32_t* slots, int64_t count);
  // Slots in use in `layer` (rows to read).
  int64_t rows(int layer) const { return tables_[layer][0].size(); }
  const std::vector<int64_t>& positions(int layer, int head) const {
    return tables_[layer][head].positions();
  }

 private:
  int64_t capacity_;
  EvictionPolicy eviction_;
  int64_t step_ = 0;                            // decode steps (layer 0 appends) so far
  std::vector<std::vector<SlotTable>> tables_;  // [layer][head]
};

}  // namespace infinigen
