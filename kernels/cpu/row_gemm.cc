#include "kernels/cpu/row_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/simd.h"

namespace infinigen::cpu {
namespace {

// Output columns per parallel task (w rows kept hot in L2 while every x row passes); a multiple
// of every kernel's tile width.
constexpr int64_t kColBlock = 48;
// x rows per pass over a column block (x rows kept in L2).
constexpr int64_t kRowBlock = 64;
// How far ahead of use a GEMV asks for weight bytes (its single pass runs row after row, so
// this reaches into the next rows), as the packed GEMVs do.
constexpr int64_t kPrefetchBytes = 2048;

// n bfloat16 values widened exactly to float32, 8 at a time (the floats Load8 makes).
inline void WidenBf16(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, WidenBf16x8(in + i));
  for (; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}

// Weight rows as a tile reads them: row c of the accessor, 8 values at column i (a multiple of
// 8), widened exactly to float32, so every format goes through the same products.
struct F32Rows {
  const float* w;
  int64_t ld;
  __m256 Load8(int64_t c, int64_t i) const { return _mm256_loadu_ps(w + c * ld + i); }
  IG_AVX512 __m512 Load16(int64_t c, int64_t i) const { return _mm512_loadu_ps(w + c * ld + i); }
  float At(int64_t c, int64_t i) const { return w[c * ld + i]; }
  const void* Address(int64_t c, int64_t i) const { return w + c * ld + i; }
  F32Rows From(int64_t j) const { return {w + j * ld, ld}; }
};
struct Bf16Rows {
  const uint16_t* w;
  int64_t ld;
  __m256 Load8(int64_t c, int64_t i) const { return WidenBf16x8(w + c * ld + i); }
  IG_AVX512 __m512 Load16(int64_t c, int64_t i) const { return WidenBf16x16(w + c * ld + i); }
  float At(int64_t c, int64_t i) const { return Bf16ToFloat(w[c * ld + i]); }
  const void* Address(int64_t c, int64_t i) const { return w + c * ld + i; }
  Bf16Rows From(int64_t j) const { return {w + j * ld, ld}; }
  void Widen(int64_t c, float* out, int64_t k) const { WidenBf16(w + c * ld, out, k); }
};
// Float32 rows wherever they lie (a row table).
struct TableRows {
  const float* const* rows;
  __m256 Load8(int64_t c, int64_t i) const { return _mm256_loadu_ps(rows[c] + i); }
  IG_AVX512 __m512 Load16(int64_t c, int64_t i) const { return _mm512_loadu_ps(rows[c] + i); }
  float At(int64_t c, int64_t i) const { return rows[c][i]; }
  const void* Address(int64_t c, int64_t i) const { return rows[c] + i; }
  TableRows From(int64_t j) const { return {rows + j}; }
};
// Bfloat16 rows wherever they lie (a row table), widened as Bf16Rows widens them.
struct Bf16TableRows {
  const uint16_t* const* rows;
  __m256 Load8(int64_t c, int64_t i) const { return WidenBf16x8(rows[c] + i); }
  IG_AVX512 __m512 Load16(int64_t c, int64_t i) const { return WidenBf16x16(rows[c] + i); }
  float At(int64_t c, int64_t i) const { return Bf16ToFloat(rows[c][i]); }
  const void* Address(int64_t c, int64_t i) const { return rows[c] + i; }
  Bf16TableRows From(int64_t j) const { return {rows + j}; }
  void Widen(int64_t c, float* out, int64_t k) const { WidenBf16(rows[c], out, k); }
};
// The scalar tail of one element, after HorizontalSum; the same function for every tile shape.
template <typename A>
inline float Tail(float s, const float* x, const A& w, int64_t c, int64_t from, int64_t k) {
  for (int64_t i = from; i < k; ++i) s = std::fma(x[i], w.At(c, i), s);
  return s;
}

// y[r, c] += x_r . w_c for r < R, c < C, each in the canonical order: 8-element block b of k
// goes into accumulator b % 2 (acc = fma(x_block, w_block, acc)), then HorizontalSum(acc0 + acc1),
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
  int64_t i = 0;
  auto step = [&](int64_t i, int64_t h) {
    __m256 wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = w.Load8(c, i);
    for (int64_t r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
      for (int64_t c = 0; c < C; ++c) acc[h][r][c] = _mm256_fmadd_ps(xv, wv[c], acc[h][r][c]);
    }
  };
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
      const float s = HorizontalSum(_mm256_add_ps(acc[0][r][c], acc[1][r][c]));
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

// Tile's products and order with 16-lane registers: lanes 0-7 of an accumulator are Tile's
// accumulator 0 (the 8-element blocks at multiples of 16), lanes 8-15 its accumulator 1 (the
// blocks after them), so each lane does the FMAs Tile's lane does, in the same order; a last odd
// block goes into lanes 0-7 alone, and the halves are added as Tile adds its two accumulators.
// One register per output element leaves room for a 4 x 4 tile in the 32 registers.
// GCC 12's AVX-512 headers build some results from _mm512_undefined_* values, which it then
// reports as uninitialized where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int64_t R, int64_t C, typename A>
IG_AVX512 void Tile16(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t k,
                      bool prefetch) {
  __m512 acc[R][C];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t k8 = k / 8 * 8;
  int64_t i = 0;
  for (; i + 16 <= k8; i += 16) {
    if (prefetch) {
      for (int64_t c = 0; c < C; ++c) {
        _mm_prefetch(static_cast<const char*>(w.Address(c, i)) + kPrefetchBytes, _MM_HINT_T0);
      }
    }
    __m512 wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = w.Load16(c, i);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + i);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (i < k8) {
    __m512 wv[C];
    for (int64_t c = 0; c < C; ++c) wv[c] = _mm512_zextps256_ps512(w.Load8(c, i));
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_zextps256_ps512(_mm256_loadu_ps(x + r * ldx + i));
      for (int64_t c = 0; c < C; ++c) {
        acc[r][c] = _mm512_mask3_fmadd_ps(xv, wv[c], acc[r][c], 0x00FF);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
      const float s = HorizontalSum(_mm256_add_ps(lo, hi));
      y[r * ldy + c] += Tail(s, x + r * ldx, w, c, k8, k);
    }
  }
}

// Tile16's products, order and result for R x rows and `cols` (<= 8) weight rows of a table,
// eight weight rows at a time (the missing ones repeat the last, their results dropped) with
// their horizontal sums folded together: the tile of short dot products (attention scores, k a
// head's width), where one sum per element costs as much as its FMAs. No panel: the rows are
// read once per tile (R x rows share each load).
template <int64_t R, typename A>
IG_AVX512 void TableTile16x8(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy,
                             int64_t cols, int64_t k) {
  int64_t at[8];
  for (int64_t c = 0; c < 8; ++c) at[c] = std::min(c, cols - 1);
  __m512 acc[R][8];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < 8; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t k8 = k / 8 * 8;
  int64_t i = 0;
  for (; i + 16 <= k8; i += 16) {
    __m512 xv[R];
    for (int64_t r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + i);
    for (int64_t c = 0; c < 8; ++c) {
      const __m512 wv = w.Load16(at[c], i);
      for (int64_t r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (i < k8) {
    __m512 xv[R];
    for (int64_t r = 0; r < R; ++r) {
      xv[r] = _mm512_zextps256_ps512(_mm256_loadu_ps(x + r * ldx + i));
    }
    for (int64_t c = 0; c < 8; ++c) {
      const __m512 wv = _mm512_zextps256_ps512(w.Load8(at[c], i));
      for (int64_t r = 0; r < R; ++r) {
        acc[r][c] = _mm512_mask3_fmadd_ps(xv[r], wv, acc[r][c], 0x00FF);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    alignas(32) float sums[8];
    _mm256_store_ps(sums, EightFoldedSums(acc[r]));
    for (int64_t c = 0; c < cols; ++c) {
      y[r * ldy + c] += Tail(sums[c], x + r * ldx, w, c, k8, k);
    }
  }
}

// Every x row against a table's `cols` weight rows, three x rows at a time.
template <typename A>
IG_AVX512 void TableColumns16(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy,
                              int64_t m, int64_t cols, int64_t k) {
  for (int64_t j = 0; j < cols; j += 8) {
    const int64_t width = std::min<int64_t>(8, cols - j);
    int64_t i = 0;
    for (; i + 3 <= m; i += 3)
      TableTile16x8<3>(x + i * ldx, ldx, w.From(j), y + i * ldy + j, ldy, width, k);
    if (m - i == 2) TableTile16x8<2>(x + i * ldx, ldx, w.From(j), y + i * ldy + j, ldy, width, k);
    if (m - i == 1) TableTile16x8<1>(x + i * ldx, ldx, w.From(j), y + i * ldy + j, ldy, width, k);
  }
}

#pragma GCC diagnostic pop

template <int64_t R, typename A>
IG_AVX512 void AnyTile16Cols(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy,
                             int64_t cols, int64_t k, bool prefetch) {
  if (cols == 4) return Tile16<R, 4>(x, ldx, w, y, ldy, k, prefetch);
  if (cols == 3) return Tile16<R, 3>(x, ldx, w, y, ldy, k, prefetch);
  if (cols == 2) return Tile16<R, 2>(x, ldx, w, y, ldy, k, prefetch);
  return Tile16<R, 1>(x, ldx, w, y, ldy, k, prefetch);
}

template <typename A>
IG_AVX512 void AnyTile16(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy,
                         int64_t rows, int64_t cols, int64_t k, bool prefetch) {
  if (rows == 4) return AnyTile16Cols<4>(x, ldx, w, y, ldy, cols, k, prefetch);
  if (rows == 3) return AnyTile16Cols<3>(x, ldx, w, y, ldy, cols, k, prefetch);
  if (rows == 2) return AnyTile16Cols<2>(x, ldx, w, y, ldy, cols, k, prefetch);
  return AnyTile16Cols<1>(x, ldx, w, y, ldy, cols, k, prefetch);
}

// The register kernels, by instruction set: tile shape (x rows by weight rows), weight rows per
// tile of a GEMV (one pass over the weights), and the tile function.
struct Avx2Kernel {
  static constexpr int64_t kRows = 2, kCols = 3, kGemvCols = 1;  // 12 of 16 ymm accumulators
  template <typename A>
  static void Run(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t rows,
                  int64_t cols, int64_t k, bool prefetch) {
    AnyTile(x, ldx, w, y, ldy, rows, cols, k, prefetch);
  }
};
struct Avx512Kernel {
  static constexpr int64_t kRows = 4, kCols = 4, kGemvCols = 4;  // 16 of 32 zmm accumulators
  template <typename A>
  static void Run(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t rows,
                  int64_t cols, int64_t k, bool prefetch) {
    AnyTile16(x, ldx, w, y, ldy, rows, cols, k, prefetch);
  }
};

// `cols` columns of y (starting at y) for every row, from the accessor's weight rows. Several
// rows of a packed format read each tile's weight rows widened once per block of x rows (the
// same floats Load8 makes, so the same products). A row table on AVX-512 (the attention's
// scores, a few x rows: TableColumns16) widens in registers, asks for nothing ahead (its caller
// prefetches the rows) and takes every x row in one pass.
template <typename K, typename A>
void ColumnBlock(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t m,
                 int64_t cols, int64_t k) {
  if constexpr (std::is_same_v<K, Avx512Kernel> &&
                (std::is_same_v<A, TableRows> || std::is_same_v<A, Bf16TableRows>)) {
    return TableColumns16(x, ldx, w, y, ldy, m, cols, k);
  }
  // A GEMV makes one pass over the weights: row after row, asking for them ahead.
  const bool gemv = m == 1;
  const int64_t step = gemv ? K::kGemvCols : K::kCols;
  thread_local std::vector<float> panel;
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t i1 = std::min(m, i0 + kRowBlock);
    for (int64_t j = 0; j < cols; j += step) {
      const int64_t width = std::min(step, cols - j);
      if constexpr (!std::is_same_v<A, F32Rows> && !std::is_same_v<A, TableRows>) {
        if (!gemv) {
          panel.resize(static_cast<size_t>(K::kCols * k));
          for (int64_t c = 0; c < width; ++c) w.Widen(j + c, panel.data() + c * k, k);
          for (int64_t i = i0; i < i1; i += K::kRows) {
            K::Run(x + i * ldx, ldx, F32Rows{panel.data(), k}, y + i * ldy + j, ldy,
                   std::min(K::kRows, i1 - i), width, k, false);
          }
          continue;
        }
      }
      for (int64_t i = i0; i < i1; i += K::kRows) {
        K::Run(x + i * ldx, ldx, w.From(j), y + i * ldy + j, ldy, std::min(K::kRows, i1 - i), width,
               k, gemv);
      }
    }
  }
}

template <typename K, typename A>
void GemmWith(const float* x, int64_t ldx, const A& w, float* y, int64_t ldy, int64_t m, int64_t n,
              int64_t k) {
  const int64_t blocks = (n + kColBlock - 1) / kColBlock;
  ParallelFor(blocks, m * n * k > (1 << 16), [&](int64_t b) {
    const int64_t j0 = b * kColBlock;
    ColumnBlock<K>(x, ldx, w.From(j0), y + j0, ldy, m, std::min(kColBlock, n - j0), k);
  });
}

template <typename A>
void Gemm(const float* x, int64_t ldx, const A& w, const float* bias, float* y, int64_t ldy,
          int64_t m, int64_t n, int64_t k, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  InitGemmOutput(bias, y, ldy, m, n, accumulate);
  if (ActiveIsa() == Isa::kAvx512) {
    GemmWith<Avx512Kernel>(x, ldx, w, y, ldy, m, n, k);
  } else {
    GemmWith<Avx2Kernel>(x, ldx, w, y, ldy, m, n, k);
  }
}

}  // namespace

void InitGemmOutput(const float* bias, float* y, int64_t ldy, int64_t m, int64_t n,
                    bool accumulate) {
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

}  // namespace infinigen::cpu
