// CudaBackend's attention: causal prefill attention (tensor-core GEMMs for long 16-bit prompts,
// the tiled CUDA-core kernel otherwise) and decode attention over listed or contiguous rows.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "common/status_macros.h"
#include "gpu_worker/backend/cuda_backend.h"
#include "gpu_worker/backend/cuda_internal.h"
#include "kernels/cuda/ops.h"

namespace infinigen {

using cuda_backend_internal::BlasType;
using cuda_backend_internal::Check;
using cuda_backend_internal::CheckBlas;
using cuda_backend_internal::M;
using cuda_backend_internal::S;
using cuda_backend_internal::ToElem;

// GemmAttentionCausal's scores of one chunk of query rows: at most this many float32 values and
// as many probabilities in the activations' type (a chunk is at least 16 rows: keys past 4M would
// pass it).
constexpr int64_t kGemmAttentionScores = int64_t{64} << 20;

size_t CudaBackend::ScratchBytes() const {
  if (!options_.gemm_causal_attention || options_.dtype == DType::kF32) return 0;
  return static_cast<size_t>(kGemmAttentionScores) * (sizeof(float) + DTypeSize(options_.dtype));
}

// The decode attention's workspace (EnsureWorkspace): at most the bound for the batch, twice
// while a grown one replaces the old (retired until the next wait; growth by half again can pass
// the bound by half: 2.5x).
size_t CudaBackend::DecodeScratchBytes(const AttentionShape& shape, int batch) const {
  return cuda::DecodeAttentionWorkspaceBound(batch, shape.num_heads, shape.num_kv_heads,
                                             shape.head_dim) *
         5 / 2;
}

// Query rows from which a 16-bit AttentionCausal goes through GEMMs.
constexpr int64_t kGemmAttentionRows = 128;

absl::Status CudaBackend::AttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                          const AttentionShape& s, MatView out) {
  if (k.dtype != q.dtype || v.dtype != q.dtype || k.head_stride != v.head_stride ||
      k.row_stride != v.row_stride || k.rows != nullptr || v.rows != nullptr) {
    return absl::InvalidArgumentError(
        "cuda backend: AttentionCausal needs K and V like q, in device memory (no row tables)");
  }
  // Long prompts in 16-bit types through tensor-core GEMMs (the tiled kernel below runs on CUDA
  // cores: 48.9 s of a 32K-token prefill of Llama-3.1-8B on an H200, 5.5 s through the GEMMs,
  // docs/benchmarks.md); short ones and float32 (held to the CPU's arithmetic) through the tiles.
  const bool gemm =
      options_.gemm_causal_attention && q.dtype != DType::kF32 && q.rows >= kGemmAttentionRows;
  if (gemm) return GemmAttentionCausal(q, k, v, q_start, s, out);
  return TiledAttentionCausal(q, k, v, q_start, s, out);
}

absl::Status CudaBackend::TiledAttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                               const AttentionShape& s, MatView out) {
  return Check(cuda::AttentionCausal(M(q), q_start, {k.data, k.head_stride, k.row_stride},
                                     {v.data, v.head_stride, v.row_stride}, s.num_heads,
                                     s.num_kv_heads, s.head_dim, s.scale, M(out), S(stream_)),
               "AttentionCausal");
}

absl::Status CudaBackend::GemmAttentionCausal(MatView q, KvView k, KvView v, int64_t q_start,
                                              const AttentionShape& s, MatView out) {
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0 || q.rows != out.rows ||
      out.dtype != q.dtype) {
    return absl::InvalidArgumentError("cuda backend: AttentionCausal shapes");
  }
  const int64_t n = q.rows, keys = q_start + n, d = s.head_dim;
  const int group = s.num_heads / s.num_kv_heads;
  // Query rows per chunk: at most 1024, and scores of at most 64M floats (256 MiB).
  const int64_t chunk = std::min<int64_t>(
      n, std::max<int64_t>(16, std::min<int64_t>(1024, kGemmAttentionScores / keys)));
  const size_t e = DTypeSize(q.dtype);
  const size_t score_bytes = static_cast<size_t>(chunk * keys) * sizeof(float);
  const size_t prob_bytes = static_cast<size_t>(chunk * keys) * e;
  if (scores_ == nullptr || scores_->size() < score_bytes + prob_bytes) {
    // Once, at the bound admission set aside (ScratchBytes): a chunked prefill's scores grow
    // with every chunk, and a reallocation is a wait. Where the device has not that much left,
    // the tiles, which need no scratch.
    if (scores_ != nullptr) IG_RETURN_IF_ERROR(Synchronize());  // may still be in use
    scores_.reset();  // (its memory first: admission set aside one of them)
    absl::StatusOr<std::unique_ptr<Buffer>> buffer =
        Allocate(std::max(score_bytes + prob_bytes, ScratchBytes()));
    if (!buffer.ok()) return TiledAttentionCausal(q, k, v, q_start, s, out);
    scores_ = std::move(*buffer);
  }
  float* scores = static_cast<float*>(scores_->data());
  void* probs = static_cast<uint8_t*>(scores_->data()) + score_bytes;
  const cudaDataType_t t = BlasType(q.dtype);
  const float one = 1.0f, zero = 0.0f;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    const int64_t rows = std::min(chunk, n - c0);
    const int64_t cols = q_start + c0 + rows;  // keys the chunk's last row sees
    for (int h = 0; h < s.num_heads; ++h) {
      const int g = h / group;
      const uint8_t* qh = static_cast<const uint8_t*>(q.data) + (c0 * q.stride + h * d) * e;
      const uint8_t* kh = static_cast<const uint8_t*>(k.data) + g * k.head_stride * e;
      const uint8_t* vh = static_cast<const uint8_t*>(v.data) + g * v.head_stride * e;
      uint8_t* oh = static_cast<uint8_t*>(out.data) + (c0 * out.stride + h * d) * e;
      // Row-major scores [rows, cols] are column-major [cols, rows] = K Q^T: K is the
      // column-major [d, cols] matrix at kh (leading dimension its row stride), transposed;
      // Q^T the column-major [d, rows] at qh.
      IG_RETURN_IF_ERROR(
          CheckBlas(cublasGemmEx(handles_->blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(cols),
                                 static_cast<int>(rows), static_cast<int>(d), &one, kh, t,
                                 static_cast<int>(k.row_stride), qh, t, static_cast<int>(q.stride),
                                 &zero, scores, CUDA_R_32F, static_cast<int>(cols),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "GemmEx (attention scores)"));
      IG_RETURN_IF_ERROR(
          Check(cuda::CausalSoftmax(scores, cols, rows, cols, q_start + c0, s.scale,
                                    {probs, ToElem(q.dtype), rows, cols, cols}, S(stream_)),
                "CausalSoftmax"));
      // Row-major out [rows, d] is column-major [d, rows] = V^T P^T: V^T the column-major
      // [d, cols] at vh, P^T the column-major [cols, rows] at probs.
      IG_RETURN_IF_ERROR(CheckBlas(
          cublasGemmEx(handles_->blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(d),
                       static_cast<int>(rows), static_cast<int>(cols), &one, vh, t,
                       static_cast<int>(v.row_stride), probs, t, static_cast<int>(cols), &zero, oh,
                       t, static_cast<int>(out.stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "GemmEx (attention output)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnsureWorkspace(size_t bytes) {
  if (workspace_ != nullptr && workspace_->size() >= bytes) return absl::OkStatus();
  // By half again at least: the decode attention's partials grow with the rows attended, a row
  // per step (an exact fit reallocated, and waited, every step).
  const size_t grown = workspace_ ? workspace_->size() * 3 / 2 : 0;
  Retire(std::move(workspace_));  // the old one may still be in use
  IG_ASSIGN_OR_RETURN(workspace_, Allocate(std::max(bytes, grown)));
  return absl::OkStatus();
}

absl::Status CudaBackend::AttentionDecode(MatView q, KvView k, KvView v, const int32_t* indices,
                                          int64_t num_rows, const AttentionShape& s, MatView out,
                                          float* weights_out) {
  if (k.dtype != q.dtype || v.dtype != q.dtype || out.dtype != q.dtype ||
      k.head_stride != v.head_stride || k.row_stride != v.row_stride || k.rows != nullptr ||
      v.rows != nullptr) {
    return absl::InvalidArgumentError(
        "cuda backend: AttentionDecode needs K, V and out like q, in device memory (no row "
        "tables)");
  }
  cuda::DecodeAttention a;
  a.type = ToElem(q.dtype);
  a.batch = 1;
  a.num_heads = s.num_heads;
  a.num_kv_heads = s.num_kv_heads;
  a.head_dim = s.head_dim;
  a.scale = s.scale;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.head_stride = k.head_stride;
  a.row_stride = k.row_stride;
  a.indices = indices;
  a.index_head_stride = num_rows;
  a.num_rows = static_cast<int32_t>(num_rows);
  a.out = out.data;
  a.weights = weights_out;
  IG_RETURN_IF_ERROR(EnsureWorkspace(cuda::DecodeAttentionWorkspaceBytes(a)));
  a.workspace = workspace_->data();
  return Check(cuda::RunDecodeAttention(a, S(stream_)), "AttentionDecode");
}

absl::Status CudaBackend::AttentionDecodeBatch(std::span<const DecodeAttentionItem> items,
                                               const AttentionShape& s) {
  bool device_counts = false;  // only the one launch reads a count in device memory
  for (const DecodeAttentionItem& it : items) device_counts = device_counts || it.count != nullptr;
  if (items.size() <= 1 && !device_counts) return Backend::AttentionDecodeBatch(items, s);
  const DecodeAttentionItem& first = items[0];
  cuda::DecodeAttention a;
  a.type = ToElem(first.q.dtype);
  a.batch = static_cast<int>(items.size());
  a.num_heads = s.num_heads;
  a.num_kv_heads = s.num_kv_heads;
  a.head_dim = s.head_dim;
  a.scale = s.scale;
  a.row_stride = first.k.row_stride;
  host_decode_seqs_.resize(items.size() * sizeof(cuda::DecodeSeq));
  int64_t most_rows = 0;
  for (size_t b = 0; b < items.size(); ++b) {
    const DecodeAttentionItem& it = items[b];
    if (it.q.dtype != first.q.dtype || it.k.dtype != it.q.dtype || it.v.dtype != it.q.dtype ||
        it.out.dtype != it.q.dtype || it.k.head_stride != it.v.head_stride ||
        it.k.row_stride != a.row_stride || it.v.row_stride != a.row_stride ||
        it.k.rows != nullptr || it.v.rows != nullptr) {
      // Not one launch's shape: each alone (AttentionDecode says what does not fit).
      if (device_counts) {
        return absl::InvalidArgumentError(
            "cuda backend: decode attention over device counts needs one launch's shape (the "
            "same dtype and row stride, rows in backend memory)");
      }
      return Backend::AttentionDecodeBatch(items, s);
    }
    cuda::DecodeSeq d;
    d.q = it.q.data;
    d.k = it.k.data;
    d.v = it.v.data;
    d.indices = it.indices;
    d.out = it.out.data;
    d.head_stride = it.k.head_stride;
    d.index_head_stride = it.num_rows;
    d.num_rows = static_cast<int32_t>(it.num_rows);
    d.count = it.count;
    cuda::DecodeSplitFor(s.num_kv_heads, it.num_rows, &d.splits, &d.rows_per_split);
    a.max_splits = std::max(a.max_splits, d.splits);
    most_rows = std::max(most_rows, it.num_rows);
    std::memcpy(host_decode_seqs_.data() + b * sizeof(d), &d, sizeof(d));
  }
  a.num_rows = static_cast<int32_t>(most_rows);
  const size_t bytes = host_decode_seqs_.size();
  if (decode_seqs_ == nullptr || decode_seqs_->size() < bytes) {
    Retire(std::move(decode_seqs_));  // the old descriptors may still be read
    IG_ASSIGN_OR_RETURN(decode_seqs_,
                        Allocate(std::max<size_t>(bytes, 64 * sizeof(cuda::DecodeSeq))));
  }
  IG_RETURN_IF_ERROR(CopyToDevice(host_decode_seqs_.data(), decode_seqs_->data(), bytes));
  a.seqs = static_cast<const cuda::DecodeSeq*>(decode_seqs_->data());
  IG_RETURN_IF_ERROR(EnsureWorkspace(cuda::DecodeAttentionWorkspaceBytes(a)));
  a.workspace = workspace_->data();
  return Check(cuda::RunDecodeAttention(a, S(stream_)), "AttentionDecodeBatch");
}

}  // namespace infinigen
