#include "gpu_worker/kv/resident_layers.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace infinigen {

ResidentLayers::ResidentLayers(Backend& backend, const KvCacheShape& shape, int layers)
    : backend_(backend), shape_(shape), layers_(std::clamp(layers, 0, shape.num_layers)) {}

size_t ResidentLayers::BytesPerToken(const KvCacheShape& shape, int layers) {
  return static_cast<size_t>(2) * std::clamp(layers, 0, shape.num_layers) * shape.num_kv_heads *
         shape.head_dim * DTypeSize(shape.dtype);
}

absl::Status ResidentLayers::Open(SequenceId seq, int64_t capacity_tokens) {
  if (layers_ == 0 || capacity_tokens <= 0) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(layers_) * shape_.num_kv_heads * capacity_tokens *
                       shape_.head_dim * DTypeSize(shape_.dtype);
  Entry e;
  IG_ASSIGN_OR_RETURN(e.k, backend_.Allocate(bytes));
  IG_ASSIGN_OR_RETURN(e.v, backend_.Allocate(bytes));
  e.capacity = capacity_tokens;
  e.length.assign(static_cast<size_t>(layers_), 0);
  entries_.insert_or_assign(seq, std::move(e));
  return absl::OkStatus();
}

void ResidentLayers::Close(SequenceId seq) { entries_.erase(seq); }

bool ResidentLayers::Holds(SequenceId seq, int layer, int64_t rows) const {
  if (layer < 0 || layer >= layers_) return false;
  auto it = entries_.find(seq);
  return it != entries_.end() && rows >= 0 && it->second.length[layer] >= rows;
}

MatView ResidentLayers::HeadRows(void* base, const Entry& e, int layer, int g, int64_t row,
                                 int64_t rows) const {
  const int64_t d = shape_.head_dim;
  uint8_t* p = static_cast<uint8_t*>(base) +
               ((static_cast<int64_t>(layer) * shape_.num_kv_heads + g) * e.capacity + row) * d *
                   static_cast<int64_t>(DTypeSize(shape_.dtype));
  return {p, shape_.dtype, rows, d, d};
}

absl::Status ResidentLayers::Append(SequenceId seq, int layer, int64_t start, MatView k,
                                    MatView v) {
  if (layer < 0 || layer >= layers_) return absl::OkStatus();
  auto it = entries_.find(seq);
  if (it == entries_.end()) return absl::OkStatus();
  Entry& e = it->second;
  const int64_t n = k.rows, d = shape_.head_dim, heads = shape_.num_kv_heads;
  if (e.length[layer] != start || start + n > e.capacity) {
    // Past the capacity (or out of order): rows [0, length) stay good for a read promised
    // before this append; reads of more rows go to the store (Holds is false for them).
    return absl::OkStatus();
  }
  for (auto [src, base] : {std::pair{k, e.k->data()}, std::pair{v, e.v->data()}}) {
    if (n == 1) {
      // One token: its heads are consecutive in the row; one strided copy puts head g at row
      // `start` of head g's block.
      const MatView heads_of_row{src.data, src.dtype, heads, d, d};
      MatView dst = HeadRows(base, e, layer, 0, start, 1);
      dst.rows = heads;
      dst.stride = e.capacity * d;
      IG_RETURN_IF_ERROR(backend_.Copy(heads_of_row, dst));
      continue;
    }
    for (int g = 0; g < heads; ++g) {
      IG_RETURN_IF_ERROR(backend_.Copy(src.Cols(g * d, d), HeadRows(base, e, layer, g, start, n)));
    }
  }
  e.length[layer] = start + n;
  return absl::OkStatus();
}

absl::Status ResidentLayers::Read(SequenceId seq, int layer, int64_t rows, void* k_out, void* v_out,
                                  int64_t rows_per_head) {
  if (!Holds(seq, layer, rows) || rows_per_head < rows) {
    return absl::InternalError(absl::StrCat("layer ", layer, " of sequence ", seq,
                                            " does not hold ", rows, " rows on the device"));
  }
  if (rows == 0) return absl::OkStatus();
  const Entry& e = entries_.find(seq)->second;
  const int64_t d = shape_.head_dim;
  for (auto [base, out] : {std::pair{e.k->data(), k_out}, std::pair{e.v->data(), v_out}}) {
    // Every head's first `rows` rows in one strided copy: [heads, rows * d], strides capacity * d
    // and rows_per_head * d.
    MatView src = HeadRows(base, e, layer, 0, 0, 1);
    src.rows = shape_.num_kv_heads;
    src.cols = rows * d;
    src.stride = e.capacity * d;
    const MatView dst{out, shape_.dtype, shape_.num_kv_heads, rows * d, rows_per_head * d};
    IG_RETURN_IF_ERROR(backend_.Copy(src, dst));
  }
  return absl::OkStatus();
}

}  // namespace infinigen
