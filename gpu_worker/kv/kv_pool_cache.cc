#include "gpu_worker/kv/kv_pool_cache.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

KvPoolCache::KvPoolCache(Backend& backend, const KvCacheShape& shape, const KvPoolConfig& config)
    : backend_(backend), shape_(shape), config_(config) {}

absl::Status KvPoolCache::Open(SequenceId seq, int64_t capacity_tokens) {
  if (sequences_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already open"));
  }
  Sequence s;
  s.capacity = config_.CapacityFor(capacity_tokens);
  s.slots = std::make_unique<PooledSlots>(shape_.num_layers, shape_.num_kv_heads, s.capacity,
                                          config_.eviction);
  const size_t bytes = static_cast<size_t>(shape_.num_kv_heads) * s.capacity * shape_.head_dim *
                       DTypeSize(shape_.dtype);
  s.layers.resize(shape_.num_layers);
  for (Layer& l : s.layers) {
    IG_ASSIGN_OR_RETURN(l.k, backend_.Allocate(bytes));
    IG_ASSIGN_OR_RETURN(l.v, backend_.Allocate(bytes));
  }
  sequences_.emplace(seq, std::move(s));
  return absl::OkStatus();
}

void KvPoolCache::Close(SequenceId seq) { sequences_.erase(seq); }

absl::StatusOr<int64_t> KvPoolCache::Length(SequenceId seq) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return it->second.layers.back().length;
}

int64_t KvPoolCache::capacity(SequenceId seq) const {
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? 0 : it->second.capacity;
}

absl::Status KvPoolCache::Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                                 int32_t* slots_out) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  Sequence& s = it->second;
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  Layer& l = s.layers[layer];
  const int64_t n = k.rows;
  if (start != l.length) {
    return absl::InvalidArgumentError(absl::StrCat("the KV pool appends in order: token ", start,
                                                   " arrived after ", l.length, " tokens"));
  }
  std::vector<int32_t>& slots = s.placed;  // reused: a decode step allocates nothing here
  slots.resize(static_cast<size_t>(n * shape_.num_kv_heads));
  IG_ASSIGN_OR_RETURN(const int64_t evicted, s.slots->Place(layer, start, n, slots.data()));
  if (layer == 0) evictions_ += evicted;
  const int d = shape_.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    for (int g = 0; g < shape_.num_kv_heads; ++g) {
      const int32_t slot = slots[t * shape_.num_kv_heads + g];
      IG_RETURN_IF_ERROR(
          backend_.Copy(k.Rows(t, 1).Cols(g * d, d),
                        shape_.HeadMajor(l.k->data(), s.capacity).Head(g, slot, 1, d)));
      IG_RETURN_IF_ERROR(
          backend_.Copy(v.Rows(t, 1).Cols(g * d, d),
                        shape_.HeadMajor(l.v->data(), s.capacity).Head(g, slot, 1, d)));
    }
  }
  if (slots_out != nullptr) std::copy(slots.begin(), slots.end(), slots_out);
  l.length = start + n;
  return absl::OkStatus();
}

absl::StatusOr<KvLayerView> KvPoolCache::Read(SequenceId seq, int layer) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  Sequence& s = it->second;
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  Layer& l = s.layers[layer];
  return KvLayerView{shape_.HeadMajor(l.k->data(), s.capacity),
                     shape_.HeadMajor(l.v->data(), s.capacity), s.slots->rows(layer)};
}

void KvPoolCache::RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || layer < 0 || layer >= shape_.num_layers || slots == nullptr) {
    return;
  }
  it->second.slots->Fetched(layer, slots, count);
}

const std::vector<int64_t>& KvPoolCache::SlotPositions(SequenceId seq, int layer, int head) const {
  return sequences_.at(seq).slots->positions(layer, head);
}

}  // namespace infinigen
