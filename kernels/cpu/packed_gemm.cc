#include "kernels/cpu/packed_gemm.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/row_gemm.h"  // InitGemmOutput, GemmRowsQ8
#include "kernels/cpu/serial_blas.h"
#include "kernels/cpu/simd.h"

namespace infinigen::cpu {
namespace {

// Weight rows widened per panel when m > 1: 256 rows of a 4096-wide matrix are 4 MiB.
constexpr int64_t kPanelRows = 256;
// How far ahead of the current block a GEMV asks for weight bytes. The hardware prefetcher
// alone leaves DRAM bandwidth unused on short per-layer streams (16 -> 24 GB/s measured with
// bench/cpu_gemv_bench on 2 cores); 2-4 KiB ahead is the measured plateau.
constexpr int64_t kPrefetchBytes = 2048;
// Below this many output rows a GEMV is not worth splitting across threads.
constexpr int64_t kParallelRows = 64;
// Up to this many activation rows, GemmQ8 multiplies quantized rows (GemmRowsQ8: decode batches).
constexpr int64_t kSmallBatchRows = 16;

float* Scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

float DotBf16(const float* x, const uint16_t* w, int64_t k) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i) + kPrefetchBytes, _MM_HINT_T0);
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), WidenBf16x8(w + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), WidenBf16x8(w + i + 8), acc1);
  }
  float s = HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < k; ++i) s += x[i] * Bf16ToFloat(w[i]);
  return s;
}

void WidenBf16Rows(const uint16_t* w, int64_t rows, int64_t k, float* out) {
  for (int64_t i = 0; i < rows * k; ++i) out[i] = Bf16ToFloat(w[i]);
}

void WidenQ8Row(const Q8Matrix& w, int64_t r, float* out) {
  const int8_t* q = w.qs + r * w.cols;
  const float* sc = w.scales + r * (w.cols / kQ8Block);
  for (int64_t c = 0; c < w.cols; ++c) out[c] = q[c] * sc[c / kQ8Block];
}

// y[:, j0 : j0 + rows] += x · panelᵀ (panel: float32 [rows, k]).
void PanelGemm(const float* x, int64_t ldx, const float* panel, int64_t rows, int64_t k, float* y,
               int64_t ldy, int64_t m) {
  // OpenBLAS runs single-threaded (SerialBlas): the team splits the panel's rows.
  ParallelRanges(rows, 16, true, [&](int64_t r0, int64_t r1) {
    SerialBlas();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, r1 - r0, k, 1.0f, x, ldx,
                panel + r0 * k, k, 1.0f, y + r0, ldy);
  });
}

}  // namespace

void GemmBf16(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  InitGemmOutput(bias, y, ldy, m, n, accumulate);
  if (m == 1) {
    ParallelFor(n, n >= kParallelRows, [&](int64_t j) { y[j] += DotBf16(x, w + j * k, k); });
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n - j0);
    float* panel = Scratch(rows * k);
    ParallelFor(rows, true,
                [&](int64_t r) { WidenBf16Rows(w + (j0 + r) * k, 1, k, panel + r * k); });
    PanelGemm(x, ldx, panel, rows, k, y + j0, ldy, m);
  }
}

void GemmQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
            int64_t ldy, int64_t m, bool accumulate) {
  // Decode batches: integer dot products on quantized activations (widening the whole matrix
  // to float would cost more than the products).
  if (m <= kSmallBatchRows) return GemmRowsQ8(x, ldx, w, bias, y, ldy, m, accumulate);
  const int64_t n = w.rows, k = w.cols;
  InitGemmOutput(bias, y, ldy, m, n, accumulate);
  for (int64_t j0 = 0; j0 < n; j0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n - j0);
    float* panel = Scratch(rows * k);
    ParallelFor(rows, true, [&](int64_t r) { WidenQ8Row(w, j0 + r, panel + r * k); });
    PanelGemm(x, ldx, panel, rows, k, y + j0, ldy, m);
  }
}

void EmbeddingBf16(const uint16_t* table, int64_t dim, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) {
    WidenBf16Rows(table + static_cast<int64_t>(ids[i]) * dim, 1, dim, out + i * out_stride);
  }
}

void EmbeddingQ8(const Q8Matrix& table, const int32_t* ids, int64_t n, float* out,
                 int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) WidenQ8Row(table, ids[i], out + i * out_stride);
}

}  // namespace infinigen::cpu
