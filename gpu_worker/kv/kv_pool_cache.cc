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
  s.capacity = config_.capacity_tokens > 0
                   ? config_.capacity_tokens
                   : static_cast<int64_t>(std::ceil(config_.capacity_fraction * capacity_tokens));
  s.capacity = std::max<int64_t>(s.capacity, 1);
  const size_t bytes = static_cast<size_t>(shape_.num_kv_heads) * s.capacity * shape_.head_dim *
                       DTypeSize(shape_.dtype);
  s.layers.resize(shape_.num_layers);
  for (Layer& l : s.layers) {
    IG_ASSIGN_OR_RETURN(l.k, backend_.Allocate(bytes));
    IG_ASSIGN_OR_RETURN(l.v, backend_.Allocate(bytes));
    l.heads.resize(shape_.num_kv_heads);
    for (SlotTable& h : l.heads) h.Resize(s.capacity);
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
  if (n > 1 && l.heads[0].size() + n > s.capacity) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefill of ", n, " tokens does not fit the sequence's KV pool capacity of ",
                     s.capacity, " tokens (", l.heads[0].size(), " stored)"));
  }
  if (layer == 0) ++s.step;
  const int d = shape_.head_dim;
  for (int64_t t = 0; t < n; ++t) {
    for (int g = 0; g < shape_.num_kv_heads; ++g) {
      bool evicted;
      const int32_t slot = l.heads[g].Place(start + t, s.step, config_.eviction, &evicted);
      evictions_ += evicted;
      IG_RETURN_IF_ERROR(
          backend_.Copy(k.Rows(t, 1).Cols(g * d, d),
                        shape_.HeadMajor(l.k->data(), s.capacity).Head(g, slot, 1, d)));
      IG_RETURN_IF_ERROR(
          backend_.Copy(v.Rows(t, 1).Cols(g * d, d),
                        shape_.HeadMajor(l.v->data(), s.capacity).Head(g, slot, 1, d)));
      if (slots_out != nullptr) slots_out[t * shape_.num_kv_heads + g] = slot;
    }
  }
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
                     shape_.HeadMajor(l.v->data(), s.capacity), l.heads[0].size()};
}

void KvPoolCache::RecordFetch(SequenceId seq, int layer, const int32_t* slots, int64_t count) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || layer < 0 || layer >= shape_.num_layers || slots == nullptr) {
    return;
  }
  Layer& l = it->second.layers[layer];
  for (int g = 0; g < shape_.num_kv_heads; ++g) {
    for (int64_t j = 0; j < count; ++j) l.heads[g].Fetched(slots[g * count + j], it->second.step);
  }
}

const std::vector<int64_t>& KvPoolCache::SlotPositions(SequenceId seq, int layer, int head) const {
  return sequences_.at(seq).layers.at(layer).heads.at(head).positions();
}

}  // namespace infinigen
