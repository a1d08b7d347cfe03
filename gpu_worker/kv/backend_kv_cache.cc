#include "gpu_worker/kv/backend_kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

BackendKvCache::BackendKvCache(Backend& backend, const KvCacheShape& shape, size_t max_bytes)
    : backend_(backend), shape_(shape), max_bytes_(max_bytes) {}

absl::Status BackendKvCache::Open(SequenceId seq, int64_t capacity_tokens) {
  if (sequences_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already open"));
  }
  Sequence s;
  s.layers.resize(shape_.num_layers);
  IG_RETURN_IF_ERROR(Grow(s, std::max<int64_t>(capacity_tokens, 16)));
  sequences_.emplace(seq, std::move(s));
  return absl::OkStatus();
}

void BackendKvCache::Close(SequenceId seq) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return;
  bytes_reserved_ -= it->second.capacity * shape_.BytesPerToken();
  sequences_.erase(it);
}

absl::StatusOr<int64_t> BackendKvCache::Length(SequenceId seq) const {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return it->second.layers.back().length;
}

absl::Status BackendKvCache::Grow(Sequence& s, int64_t min_capacity) {
  const int64_t capacity = std::max(min_capacity, s.capacity * 2);
  const size_t extra = (capacity - s.capacity) * shape_.BytesPerToken();
  if (max_bytes_ > 0 && bytes_reserved_ + extra > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", capacity, " tokens need ", extra, " more bytes, ",
                     max_bytes_ - bytes_reserved_, " of ", max_bytes_, " left"));
  }
  const size_t bytes = static_cast<size_t>(shape_.num_kv_heads) * capacity * shape_.head_dim *
                       DTypeSize(shape_.dtype);
  for (Layer& layer : s.layers) {
    IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> k, backend_.Allocate(bytes));
    IG_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> v, backend_.Allocate(bytes));
    if (layer.length > 0) {
      for (int g = 0; g < shape_.num_kv_heads; ++g) {
        IG_RETURN_IF_ERROR(backend_.Copy(
            shape_.HeadMajor(layer.k->data(), s.capacity).Head(g, 0, layer.length, shape_.head_dim),
            shape_.HeadMajor(k->data(), capacity).Head(g, 0, layer.length, shape_.head_dim)));
        IG_RETURN_IF_ERROR(backend_.Copy(
            shape_.HeadMajor(layer.v->data(), s.capacity).Head(g, 0, layer.length, shape_.head_dim),
            shape_.HeadMajor(v->data(), capacity).Head(g, 0, layer.length, shape_.head_dim)));
      }
    }
    layer.k = std::move(k);
    layer.v = std::move(v);
  }
  bytes_reserved_ += extra;
  s.capacity = capacity;
  return absl::OkStatus();
}

absl::Status BackendKvCache::Append(SequenceId seq, int layer, int64_t start, MatView k, MatView v,
                                    int32_t* slots_out) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  Sequence& s = it->second;
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  const int64_t n = k.rows;
  const int64_t kv_cols = static_cast<int64_t>(shape_.num_kv_heads) * shape_.head_dim;
  // Rows of another dtype (float32 activations into bf16 K/V) are converted by Backend::Copy.
  if (k.cols != kv_cols || v.cols != kv_cols || v.rows != n || k.dtype != v.dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("K/V rows must be [n, ", kv_cols, "] of one dtype"));
  }
  if (start < 0 || start > s.layers[layer].length) {
    return absl::InvalidArgumentError(absl::StrCat("append at ", start,
                                                   " would leave a hole after ",
                                                   s.layers[layer].length, " stored tokens"));
  }
  if (start + n > s.capacity) IG_RETURN_IF_ERROR(Grow(s, start + n));
  Layer& l = s.layers[layer];
  for (int g = 0; g < shape_.num_kv_heads; ++g) {
    IG_RETURN_IF_ERROR(backend_.Copy(
        k.Cols(g * shape_.head_dim, shape_.head_dim),
        shape_.HeadMajor(l.k->data(), s.capacity).Head(g, start, n, shape_.head_dim)));
    IG_RETURN_IF_ERROR(backend_.Copy(
        v.Cols(g * shape_.head_dim, shape_.head_dim),
        shape_.HeadMajor(l.v->data(), s.capacity).Head(g, start, n, shape_.head_dim)));
  }
  l.length = start + n;
  if (slots_out != nullptr) {
    for (int64_t t = 0; t < n; ++t) {
      std::fill_n(slots_out + t * shape_.num_kv_heads, shape_.num_kv_heads,
                  static_cast<int32_t>(start + t));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<KvLayerView> BackendKvCache::Read(SequenceId seq, int layer) {
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  Sequence& s = it->second;
  if (layer < 0 || layer >= shape_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  Layer& l = s.layers[layer];
  return KvLayerView{shape_.HeadMajor(l.k->data(), s.capacity),
                     shape_.HeadMajor(l.v->data(), s.capacity), l.length};
}

}  // namespace infinigen
