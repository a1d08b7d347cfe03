// CpuBackend's attention: a prompt chunk's causal attention, one decode token's over its rows,
// and a layer's decode tokens together (their tasks in one parallel loop, rows attended up to a
// count in the backend's memory), over kernels/cpu/attention.cc.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"

namespace infinigen {
namespace {

// K or V rows for the CPU kernels: float32 or bfloat16.
absl::StatusOr<cpu::KvRows> KernelRows(const KvView& kv, const char* op) {
  if (kv.dtype != DType::kF32 && kv.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cpu backend: ", op, " reads float32 or bfloat16 K/V, got ", DTypeName(kv.dtype)));
  }
  return cpu::KvRows{kv.data, kv.head_stride, kv.row_stride, kv.rows, kv.dtype == DType::kBF16};
}

}  // namespace

absl::Status CpuBackend::AttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                         const AttentionShape& s, MatView out) {
  if (auto st = CheckF32(q, "AttentionCausal"); !st.ok()) return st;
  if (k.rows != nullptr || v.rows != nullptr) {
    return absl::InvalidArgumentError(
        "cpu backend: AttentionCausal reads K/V rows packed, not by "
        "row table");
  }
  IG_ASSIGN_OR_RETURN(cpu::KvRows kr, KernelRows(k, "AttentionCausal"));
  IG_ASSIGN_OR_RETURN(cpu::KvRows vr, KernelRows(v, "AttentionCausal"));
  // OpenBLAS multiplies float32 only: bf16 K/V always take the per-row kernel.
  const bool rows = options_.batch_invariant || kr.bf16 || vr.bf16;
  const auto causal = rows ? cpu::AttentionCausalRows : cpu::AttentionCausal;
  causal(q.As<float>(), q.stride, q.rows, q_start, kr, vr, s.num_heads, s.num_kv_heads, s.head_dim,
         s.scale, out.As<float>(), out.stride);
  return absl::OkStatus();
}

absl::StatusOr<cpu::DecodeQuery> CpuBackend::DecodeQueryOf(MatView q, KvView k, KvView v,
                                                           const int32_t* indices, int64_t num_rows,
                                                           MatView out) {
  if (auto st = CheckF32(q, "AttentionDecode"); !st.ok()) return st;
  IG_ASSIGN_OR_RETURN(cpu::KvRows kr, KernelRows(k, "AttentionDecode"));
  IG_ASSIGN_OR_RETURN(cpu::KvRows vr, KernelRows(v, "AttentionDecode"));
  return cpu::DecodeQuery{q.As<float>(), kr, vr, indices, num_rows, out.As<float>()};
}

absl::Status CpuBackend::AttentionDecode(MatView q, KvView k, KvView v, const int32_t* indices,
                                         int64_t num_rows, const AttentionShape& s, MatView out,
                                         float* weights_out) {
  IG_ASSIGN_OR_RETURN(const cpu::DecodeQuery d, DecodeQueryOf(q, k, v, indices, num_rows, out));
  cpu::AttentionDecode(d.q, d.k, d.v, d.indices, d.num_rows, s.num_heads, s.num_kv_heads,
                       s.head_dim, s.scale, d.out, weights_out);
  return absl::OkStatus();
}

absl::Status CpuBackend::AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                              const AttentionShape& shape) {
  // Each head's first n of its num_rows-long list, packed for the kernel (room for all first:
  // the queries point into it).
  size_t packed = 0;
  for (const DecodeAttentionItem& it : items) {
    if (it.count == nullptr || it.indices == nullptr) continue;
    const int64_t n = std::clamp<int64_t>(*it.count, 0, it.num_rows);
    if (n < it.num_rows) packed += static_cast<size_t>(shape.num_kv_heads * n);
  }
  if (packed_indices_.size() < packed) packed_indices_.resize(packed);
  decode_queries_.clear();
  size_t at = 0;
  for (const DecodeAttentionItem& it : items) {
    int64_t n = it.num_rows;
    const int32_t* indices = it.indices;
    if (it.count != nullptr) {
      n = std::clamp<int64_t>(*it.count, 0, it.num_rows);
      if (indices != nullptr && n < it.num_rows) {
        for (int64_t g = 0; g < shape.num_kv_heads; ++g) {
          std::copy_n(it.indices + g * it.num_rows, n, packed_indices_.begin() + at + g * n);
        }
        indices = packed_indices_.data() + at;
        at += static_cast<size_t>(shape.num_kv_heads * n);
      }
    }
    IG_ASSIGN_OR_RETURN(const cpu::DecodeQuery d,
                        DecodeQueryOf(it.q, it.k, it.v, indices, n, it.out));
    decode_queries_.push_back(d);
  }
  cpu::AttentionDecodeBatch(decode_queries_, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                            shape.scale);
  return absl::OkStatus();
}

}  // namespace infinigen
