// CpuBackend's InfiniGen operations: the partial key cache and the choice of rows, computed
// exactly as the host selection policy computes them (kernels/cpu/selection.h), so that a
// policy choosing through the backend and one choosing on the host pick the same rows.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/selection.h"

namespace infinigen {
namespace {

// Row r of m as float32 (m's own floats, or widened into `scratch`).
const float* RowAsFloat(const MatView& m, int64_t r, std::vector<float>& scratch) {
  if (m.dtype == DType::kF32) return m.As<const float>() + r * m.stride;
  scratch.resize(static_cast<size_t>(m.cols));
  const uint16_t* row = m.As<const uint16_t>() + r * m.stride;
  for (int64_t c = 0; c < m.cols; ++c) scratch[c] = Bf16ToFloat(row[c]);
  return scratch.data();
}

absl::Status CheckFloatRows(const MatView& m, const char* op) {
  if (m.dtype != DType::kF32 && m.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": float32 or bfloat16 rows only"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuBackend::AppendPartialKeys(MatView k, const float* skew, const PartialKeysShape& s,
                                           void* keys, int64_t first_row) {
  IG_RETURN_IF_ERROR(CheckFloatRows(k, "AppendPartialKeys"));
  const int kv_heads = s.num_kv_heads, d = s.head_dim, p = s.partial_dim;
  if (first_row < 0 || first_row + k.rows > s.capacity || k.cols != int64_t{kv_heads} * d ||
      p < 1 || p > d) {
    return absl::InvalidArgumentError(
        absl::StrCat("AppendPartialKeys: rows ", first_row, "..", first_row + k.rows, " of ",
                     s.capacity, ", ", k.cols, " columns for ", kv_heads, " heads of ", d));
  }
  uint16_t* out = static_cast<uint16_t*>(keys);
  cpu::ParallelFor(k.rows, k.rows >= 64, [&](int64_t t) {
    thread_local std::vector<float> scratch, partial;
    partial.resize(static_cast<size_t>(p));
    const float* row = RowAsFloat(k, t, scratch);
    for (int g = 0; g < kv_heads; ++g) {
      cpu::ProjectPartial(row + static_cast<size_t>(g) * d, skew + static_cast<size_t>(g) * d * p,
                          d, p, partial.data());
      for (int c = 0; c < p; ++c) {
        out[(static_cast<size_t>(g) * p + c) * s.capacity + first_row + t] =
            FloatToBf16(partial[c]);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::ChooseRows(const RowChoiceRequest& r, void* /*workspace*/) {
  IG_RETURN_IF_ERROR(CheckFloatRows(r.q_partial, "ChooseRows"));
  const PartialKeysShape& s = r.keys_shape;
  if (r.num_heads <= 0 || s.num_kv_heads <= 0 || r.num_heads % s.num_kv_heads != 0 ||
      r.rows > s.capacity || r.q_partial.cols != int64_t{r.num_heads} * s.partial_dim ||
      r.index_capacity < std::min(r.rows, r.k_max)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ChooseRows: ", r.rows, " rows of ", s.capacity, ", index capacity ", r.index_capacity,
        " for a budget of ", r.k_max, ", ", r.q_partial.cols, " query columns"));
  }
  thread_local std::vector<float> scratch;
  cpu::RowChoice c;
  c.num_heads = r.num_heads;
  c.num_kv_heads = s.num_kv_heads;
  c.partial_dim = s.partial_dim;
  c.scale = r.scale;
  c.alpha = r.alpha;
  c.rows = r.rows;
  c.capacity = s.capacity;
  c.k_min = r.k_min;
  c.k_max = r.k_max;
  c.margin = r.margin;
  c.force_last = r.force_last;
  *r.count = static_cast<int32_t>(cpu::ChooseRows(c, RowAsFloat(r.q_partial, 0, scratch),
                                                  static_cast<const uint16_t*>(r.keys), r.indices,
                                                  r.index_capacity));
  return absl::OkStatus();
}

}  // namespace infinigen
