// A KvCache in the backend's own memory: per sequence and layer, K and V as [num_kv_heads,
// capacity, head_dim] blocks that attention reads in place. The all-on-device baseline, and
// what the local CLI and the tests use.
#pragma once

#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gpu_worker/kv/kv_cache.h"

namespace infinigen {

class BackendKvCache final : public ResidentKvCache {
 public:
  // `max_bytes`: total K/V bytes of all sequences (0: unlimited).
  BackendKvCache(Backend& backend, const KvCacheShape& shape, size_t max_bytes = 0);

  absl::Status Open(SequenceId seq, int64_t capacity_tokens) override;
  void Close(SequenceId seq) override;
  absl::StatusOr<int64_t> Length(SequenceId seq) const override;
  absl::Status Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                      int32_t* slots_out = nullptr) override;
  absl::StatusOr<KvLayerView> Read(SequenceId seq, int layer) override;

  size_t bytes_reserved() const { return bytes_reserved_; }

 private:
  struct Layer {
    std::unique_ptr<Buffer> k, v;  // [num_kv_heads, capacity, head_dim]
    int64_t length = 0;
  };
  struct Sequence {
    int64_t capacity = 0;
    std::vector<Layer> layers;
  };

  absl::Status Grow(Sequence& s, int64_t min_capacity);

  Backend& backend_;
  KvCacheShape shape_;
  size_t max_bytes_;
  size_t bytes_reserved_ = 0;
  absl::flat_hash_map<SequenceId, Sequence> sequences_;
};

}  // namespace infinigen
