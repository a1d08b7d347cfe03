#include "kernels/cpu/row_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/packed_gemm.h"

namespace infinigen::cpu {
namespace {

// Tile of the register kernel: kRows rows of x times kCols rows of w, two 8-lane accumulators
// per output element (12 of the 16 ymm registers).
constexpr int64_t kRows = 2;
constexpr int64_t kCols = 3;
// Output columns per parallel task (w rows kept hot in L2 while every x row passes).
constexpr int64_t kColBlock = 48;
// x rows per pass over a column block (x rows kept in L2).
constexpr int64_t kRowBlock = 64;
// How far ahead of use a GEMV asks for weight bytes (its single pass runs row after row, so
// this reaches into the next rows), as the packed GEMVs do.
constexpr int64_t kPrefetchBytes = 2048;

// The one reduction every element goes through: lanes summed as ((0+4)+(2+6))+((1+5)+(3+7)).
inline float Reduce(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// n bfloat16 values widened exactly to float32, 8 at a time (the floats Load8 makes).
inline void WidenBf16(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

// Weight rows as a tile reads them: row c of the accessor, 8 values at column i (a multiple of
// 8), widened exactly to float32, so every format goes through the same products.
struct F32Rows {
  const float* w;
  int64_t ld;
  __m256 Load8(int64_t c, int64_t i) const { return _mm256_loadu_ps(w + c * ld + i); }
  float At(int64_t c, int64_t i) const { return w[c * ld + i]; }
  const void* Address(int64_t c, int64_t i) const { return w + c * ld + i; }
  F32Rows From(int64_t j) const { return {w + j * ld, ld}; }
};
struct Bf16Rows {
  const uint16_t* w;
  int64_t ld;
  __m256 Load8(int64_t c, int64_t i) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * ld + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  float At(int64_t c, int64_t i) const { return Bf16ToFloat(w[c * ld + i]); }
  const void* Address(int64_t c, int64_t i) const { return w + c * ld + i; }
  Bf16Rows From(int64_t j) const { return {w + j * ld, ld}; }
  void Widen(int64_t c, float* out, int64_t k) const { WidenBf16(w + c * ld, out, k); }
};
// Float32 rows wherever they lie (a row table).
struct TableRows {
  const float* const* rows;
  __m256 Load8(int64_t c, int64_t i) const { return _mm256_loadu_ps(rows[c] + i); }
  float At(int64_t c, int64_t i) const { return rows[c][i]; }
  const void* Address(int64_t c, int64_t i) const { return rows[c] + i; }
  TableRows From(int64_t j) const { return {rows + j}; }
};
// Bfloat16 rows wherever they lie (a row table), widened as Bf16Rows widens them.
struct Bf16TableRows {
  const uint16_t* const* rows;
  __m256 Load8(int64_t c, int64_t i) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  float At(int64_t c, int64_t i) const { return Bf16ToFloat(rows[c][i]); }
  const void* Address(int64_t c, int64_t i) const { return rows[c] + i; }
  Bf16TableRows From(int64_t j) const { return {rows + j}; }
  void Widen(int64_t c, float* out, int64_t k) const { WidenBf16(rows[c], out, k); }
};
// Q8: w[r, c] = qs[r, c] * scales[r, c / 32] (packed_gemm.h), the product taken in float32.
struct Q8Rows {
  const int8_t* qs;
  const float* scales;
  int64_t ld;  // columns
  __m256 Load8(int64_t c, int64_t i) const {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + c * ld + i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                         _mm256_set1_ps(scales[c * (ld / kQ8Block) + i / kQ8Block]));
  }
  float At(int64_t c, int64_t i) const {
    return static_cast<float>(qs[c * ld + i]) * scales[c * (ld / kQ8Block) + i / kQ8Block];
  }
  const void* Address(int64_t c, int64_t i) const { return qs + c * ld + i; }
  Q8Rows From(int64_t j) const { return {qs + j * ld, scales + j * (ld / kQ8Block), ld}; }
  void Widen(int64_t c, float* out, int64_t k) const {
    for (int64_t i = 0; i < k; ++i) out[i] = At(c, i);
  }
};

// The scalar tail of one element, after Reduce; the same function for every tile shape.
template <typename A>
inline float Tail(float s, const float* x, const A& w, int64_t c, int64_t from, int64_t k) {
  for (int64_t i = from; i < k; ++i) s = std::fma(x[i], w.At(c, i), s);
  return s;
}

// y[r, c] += x_r . w_c for r < R, c < C, each in the canonical order: 8-element block b of k
// goes into accumulator b % 2 (acc = fma(x_block, w_block, acc)), then Reduce(acc0 + acc1),
// then the tail. Two chains per element hide the FMA latency of a GEMV's single row.
template <int64_t R, int64_t C, typename A>
inline void Tile(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t k,
                 bool prefetch) {
  __m256 acc[2][R][C];
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) acc[h][r][c] = _mm256_setzero_ps();
    }
  }
  const int64_t k8 = k / 8 * 8;
  auto step = [&](int64_t i, int64_t h) {
    __m256 wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = w.Load8(c, i);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int64_t c = 0; c < C; ++c) acc[h][r][c] = _mm256_fmadd_ps(xv, wv[c], acc[h][r][c]);
    }
  };
  int64_t i = 0;
  for (; i + 16 <= k8; i += 16) {
    if (prefetch) {
      for (int64_t c = 0; c < C; ++c) {
        _mm_prefetch(static_cast<const char*>(w.Address(c, i)) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    step(i, 0);
    step(i + 8, 1);
  }
  if (i < k8) step(i, 0);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const float s = Reduce(_mm256_add_ps(acc[0][r][c], acc[1][r][c]));
      y[r * ldy + c] += Tail(s, x + r * ldx, w, c, k8, k);
    }
  }
}

// Any tile shape gives each element the same order: the edges take smaller ones.
template <typename A>
void AnyTile(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t rows,
             int64_t cols, int64_t k, bool prefetch) {
  if (rows == 2 && cols == 3) return Tile<2, 3>(x, ldx, w, y, ldy, k, prefetch);
  if (rows == 2 && cols == 2) return Tile<2, 2>(x, ldx, w, y, ldy, k, prefetch);
  if (rows == 2) return Tile<2, 1>(x, ldx, w, y, ldy, k, prefetch);
  if (cols == 3) return Tile<1, 3>(x, ldx, w, y, ldy, k, prefetch);
  if (cols == 2) return Tile<1, 2>(x, ldx, w, y, ldy, k, prefetch);
  return Tile<1, 1>(x, ldx, w, y, ldy, k, prefetch);
}

void InitOutput(const float* bias, float* y, int64_t ldy, int64_t m, int64_t n, bool accumulate) {
  for (int64_t r = 0; r < m; ++r) {
    float* yr = y + r * ldy;
    if (!accumulate) {
      if (bias != nullptr) {
        std::memcpy(yr, bias, n * sizeof(float));
      } else {
        std::memset(yr, 0, n * sizeof(float));
      }
    } else if (bias != nullptr) {
      for (int64_t i = 0; i < n; ++i) yr[i] += bias[i];
    }
  }
}

// `cols` columns of y (starting at y) for every row, from the accessor's weight rows. Several
// rows of a packed format read each tile's weight rows widened once per block of x rows (the
// same floats Load8 makes, so the same products).
template <typename A>
void ColumnBlock(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t m,
                 int64_t cols, int64_t k) {
  // A GEMV makes one pass over the weights: row after row, asking for them ahead.
  const bool gemv = m == 1;
  const int64_t step = gemv ? 1 : kCols;
  thread_local std::vector<float> panel;
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t i1 = std::min(m, i0 + kRowBlock);
    for (int64_t j = 0; j < cols; j += step) {
      const int64_t width = std::min(step, cols - j);
      if constexpr (!std::is_same_v<A, F32Rows> && !std::is_same_v<A, TableRows>) {
        if (!gemv) {
          panel.resize(static_cast<size_t>(kCols * k));
          for (int64_t c = 0; c < width; ++c) w.Widen(j + c, panel.data() + c * k, k);
          for (int64_t i = i0; i < i1; i += kRows) {
            AnyTile(x + i * ldx, ldx, F32Rows{panel.data(), k}, y + i * ldy + j, ldy,
                    std::min(kRows, i1 - i), width, k, false);
          }
          continue;
        }
      }
      for (int64_t i = i0; i < i1; i += kRows) {
        AnyTile(x + i * ldx, ldx, w.From(j), y + i * ldy + j, ldy, std::min(kRows, i1 - i), width,
                k, gemv);
      }
    }
  }
}

template <typename A>
void Gemm(const float* x, int64_t ldx, const A& w, const float* bias, float* y, int64_t ldy,
          int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  InitOutput(bias, y, ldy, m, n, accumulate);
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (m * n * k > (1 << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j0 = b * kColBlock;
    ColumnBlock(x, ldx, w.From(j0), y + j0, ldy, m, std::min(kColBlock, n - j0), k);
  }
}

}  // namespace

void GemmRowsF32(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias,
                 float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  Gemm(x, ldx, F32Rows{w, ldw}, bias, y, ldy, m, n, k, accumulate);
}

void GemmRowsBf16(const float* x, int64_t ldx, const uint16_t* w, const float* bias, float* y,
                  int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  Gemm(x, ldx, Bf16Rows{w, k}, bias, y, ldy, m, n, k, accumulate);
}

void GemmRowsF32Table(const float* x, int64_t ldx, const float* const* w_rows, const float* bias,
                      float* y, int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  Gemm(x, ldx, TableRows{w_rows}, bias, y, ldy, m, n, k, accumulate);
}

void GemmRowsBf16Table(const float* x, int64_t ldx, const uint16_t* const* w_rows,
                       const float* bias, float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate) {
  Gemm(x, ldx, Bf16TableRows{w_rows}, bias, y, ldy, m, n, k, accumulate);
}

void GemmRowsQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
                int64_t ldy, int64_t m, bool accumulate) {
  Gemm(x, ldx, Q8Rows{w.qs, w.scales, w.cols}, bias, y, ldy, m, w.rows, w.cols, accumulate);
}

}  // namespace infinigen::cpu
