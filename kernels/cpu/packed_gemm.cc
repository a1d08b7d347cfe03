#include "kernels/cpu/packed_gemm.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/row_gemm.h"  // InitGemmOutput
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
// Up to this many activation rows, GemmQ8 multiplies quantized rows directly (decode batches).
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

// x quantized like a weight row: int8 values and one scale per 32, so that a Q8 row times x is
// an integer dot product per block (llama.cpp's Q8_0 x Q8_0 scheme). Converting int8 weights
// to float costs more than reading them; the integer path keeps the GEMV memory-bound.
struct QuantizedVector {
  const int8_t* qs;
  const float* scales;
};

QuantizedVector QuantizeActivations(const float* x, int64_t k) {
  thread_local std::vector<int8_t> qs;
  thread_local std::vector<float> scales;
  if (static_cast<int64_t>(qs.size()) < k) qs.resize(k);
  if (static_cast<int64_t>(scales.size()) < k / kQ8Block) scales.resize(k / kQ8Block);
  QuantizeQ8(x, 1, k, qs.data(), scales.data());
  return {qs.data(), scales.data()};
}

// Sum over blocks of (w_block · x_block) * w_scale * x_scale, two rows at a time so that the
// |x| and sign work is shared.
inline void DotQ8Rows2(const QuantizedVector& x, const int8_t* w0, const float* s0,
                       const int8_t* w1, const float* s1, int64_t blocks, float* out0,
                       float* out1) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + b * kQ8Block + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + b * kQ8Block + kPrefetchBytes), _MM_HINT_T0);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qs + b * kQ8Block));
    const __m256i ax = _mm256_sign_epi8(xv, xv);
    const __m256i wv0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * kQ8Block));
    const __m256i wv1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + b * kQ8Block));
    // |x| * (w * sign(x)) = x * w; pairs sum to at most 2 * 127 * 127, inside int16.
    const __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv0, xv)), ones);
    const __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv1, xv)), ones);
    const float xs = x.scales[b];
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(xs * s0[b]), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(xs * s1[b]), acc1);
  }
  *out0 += HorizontalSum(acc0);
  *out1 += HorizontalSum(acc1);
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
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, rows, k, 1.0f, x, ldx, panel, k, 1.0f, y,
              ldy);
}

}  // namespace

void QuantizeQ8(const float* w, int64_t rows, int64_t cols, int8_t* qs, float* scales) {
  const int64_t blocks = cols / kQ8Block;
#pragma omp parallel for if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = w + r * cols + b * kQ8Block;
      float amax = 0.0f;
      for (int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::abs(src[i]));
      const float scale = amax / 127.0f;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      scales[r * blocks + b] = scale;
      int8_t* dst = qs + r * cols + b * kQ8Block;
      for (int64_t i = 0; i < kQ8Block; ++i) {
        dst[i] = static_cast<int8_t>(std::lrintf(src[i] * inv));
      }
    }
  }
}

void GemmBf16(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y,
              int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  InitGemmOutput(bias, y, ldy, m, n, accumulate);
  if (m == 1) {
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (int64_t j = 0; j < n; ++j) y[j] += DotBf16(x, w + j * k, k);
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n - j0);
    float* panel = Scratch(rows * k);
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) WidenBf16Rows(w + (j0 + r) * k, 1, k, panel + r * k);
    PanelGemm(x, ldx, panel, rows, k, y + j0, ldy, m);
  }
}

void GemmQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
            int64_t ldy, int64_t m, bool accumulate) {
  const int64_t n = w.rows, k = w.cols, blocks = k / kQ8Block;
  InitGemmOutput(bias, y, ldy, m, n, accumulate);
  if (m == 1) {
    const QuantizedVector xq = QuantizeActivations(x, k);
    const int64_t pairs = n / 2;
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t j = 2 * p;
      DotQ8Rows2(xq, w.qs + j * k, w.scales + j * blocks, w.qs + (j + 1) * k,
                 w.scales + (j + 1) * blocks, blocks, &y[j], &y[j + 1]);
    }
    if (n % 2 != 0) {
      float unused = 0.0f;
      DotQ8Rows2(xq, w.qs + (n - 1) * k, w.scales + (n - 1) * blocks, w.qs + (n - 1) * k,
                 w.scales + (n - 1) * blocks, blocks, &y[n - 1], &unused);
    }
    return;
  }
  if (m <= kSmallBatchRows) {
    // A decode batch: widening the whole matrix to float would cost more than the products.
    // Quantize each activation row as the m == 1 path does (so a row gets the same result in a
    // batch as alone) and stream every weight row pair once for all m rows.
    thread_local std::vector<int8_t> qs;
    thread_local std::vector<float> scales;
    qs.resize(static_cast<size_t>(m * k));
    scales.resize(static_cast<size_t>(m * blocks));
    for (int64_t i = 0; i < m; ++i) {
      QuantizeQ8(x + i * ldx, 1, k, qs.data() + i * k, scales.data() + i * blocks);
    }
    const int8_t* xq = qs.data();
    const float* xs = scales.data();
    const int64_t pairs = (n + 1) / 2;
#pragma omp parallel for schedule(static) if (n * m >= kParallelRows)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t j = 2 * p;
      const int64_t j1 = j + 1 < n ? j + 1 : j;  // an odd last row pairs with itself
      for (int64_t i = 0; i < m; ++i) {
        float unused = 0.0f;
        float* y0 = y + i * ldy + j;
        float* y1 = j1 != j ? y + i * ldy + j1 : &unused;
        DotQ8Rows2({xq + i * k, xs + i * blocks}, w.qs + j * k, w.scales + j * blocks,
                   w.qs + j1 * k, w.scales + j1 * blocks, blocks, y0, y1);
      }
    }
    return;
  }
  for (int64_t j0 = 0; j0 < n; j0 += kPanelRows) {
    const int64_t rows = std::min(kPanelRows, n - j0);
    float* panel = Scratch(rows * k);
#pragma omp parallel for
    for (int64_t r = 0; r < rows; ++r) WidenQ8Row(w, j0 + r, panel + r * k);
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
