// A KvCache with a memory limit per sequence: the KV pool of INFINIGEN.md. Each (layer, KV
// head) holds at most `capacity` tokens; a decode token that finds its head full overwrites a
// victim's slot. Victims: `counter` (the lowest fetch count among the older half, the paper's
// policy), `fifo` (the oldest) or `lru` (the least recently fetched). An evicted token is gone:
// no later step can select it. Prefill must fit the capacity.
#pragma once

#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gpu_worker/kv/kv_cache.h"
#include "gpu_worker/kv/kv_pool.h"

namespace infinigen {

class KvPoolCache final : public ResidentKvCache {
 public:
  KvPoolCache(Backend& backend, const KvCacheShape& shape, const KvPoolConfig& config);

  absl::Status Open(SequenceId seq, int64_t capacity_tokens) override;
  void Close(SequenceId seq) override;
  absl::StatusOr<int64_t> Length(SequenceId seq) const override;
  absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                      int32_t* slots_out = nullptr) override;
  absl::StatusOr<KvLayerView> Read(SequenceId seq, int layer) override;
  void RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) override;

  // Position of the token in each slot of one head (tests and metrics).
  const std::vector<int64_t>& SlotPositions(SequenceId seq, int layer, int head) const;
  int64_t capacity(SequenceId seq) const;
  int64_t evictions() const { return evictions_; }  // tokens (layer 0, every head)

 private:
  struct Layer {
    std::unique_ptr<Buffer> k, v;  // [num_kv_heads, capacity, head_dim]
    int64_t length = 0;            // tokens appended
  };
  struct Sequence {
    int64_t capacity = 0;
    std::vector<Layer> layers;
    std::unique_ptr<PooledSlots> slots;
    std::vector<int32_t> placed;  // the slots of the last append, [tokens, num_kv_heads]
  };

  Backend& backend_;
  KvCacheShape shape_;
  KvPoolConfig config_;
  int64_t evictions_ = 0;
  absl::flat_hash_map<SequenceId, Sequence> sequences_;
};

}  // namespace infinigen
