// The int8 dot GEMM's AVX-512 VNNI kernel (the arithmetic int8_dot.h defines; the same bits
// as the AVX2 kernel of int8_dot_gemm.cc).
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/int8_dot.h"

namespace infinigen::cpu::int8_dot {
namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// A pair's 64 values as VNNI's unsigned operand: from the panel (at its values + offset) or
// made from w's block `at`.
template <typename F>
IG_VNNI inline __m512i PairValues16(const typename F::Matrix& w, int64_t at, Panel panel,
                                    int64_t offset) {
  return panel.values != nullptr ? _mm512_loadu_si512(panel.values + offset) : F::Pair16(w, at);
}

// Q8 and Q6_K: 16 lanes, as Tile8's two halves.
template <typename F, int R, int C>
IG_VNNI void Tile16(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w, int64_t c0,
                    Panel panel, float* y, int64_t ldy) {
  static_assert(!F::kMinimums);
  const int64_t blocks = x.blocks, pairs = blocks / 2;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i q[C];
    __m512 dv[C];
    for (int c = 0; c < C; ++c) {
      const int64_t at = (c0 + c) * blocks + 2 * p;
      q[c] = PairValues16<F>(w, at, panel, c * x.k + 64 * p);
      dv[c] = F::Scales16(w, at);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.Values(r0 + r) + 64 * p);
      const __m512i start = F::Start16(xv);
      const __m512 dxv = PairScales16<F>(x.Scales(r0 + r) + 2 * p);
      for (int c = 0; c < C; ++c) {
        const __m512i dot = _mm512_dpbusd_epi32(start, q[c], xv);
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dxv), dv[c], acc[r][c]);
      }
    }
  }
  if constexpr (F::kOddBlock) {
    if (blocks % 2 == 1) {  // the odd last block: its elements in order, into lanes 0-7
      const int64_t b = blocks - 1;
      for (int c = 0; c < C; ++c) {
        const int64_t at = (c0 + c) * blocks + b;
        const __m256i q =
            OddBlockValues<F>(w, at, panel.values != nullptr ? panel.values + c * x.k : nullptr, b);
        const __m512 dw = _mm512_set1_ps(F::Scales(w)[at]);
        for (int r = 0; r < R; ++r) {
          const __m512 f = _mm512_zextps256_ps512(OddBlockProduct<F>(q, x, r0 + r, b));
          acc[r][c] = _mm512_mask3_fmadd_ps(f, dw, acc[r][c], 0x00FF);
        }
      }
    }
  } else {
    assert(blocks % 2 == 0);
  }
  __m256 v[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
      v[r][c] = _mm256_add_ps(lo, hi);
    }
  }
  AddTileSums<R, C>(v, y, ldy);
}

// The summed formats (Q4_1, Q5_1): VNNI's 16 lanes of a pair, its two halves added as integers,
// are SummedTile8's 8 lanes; the rest is SummedTile8's arithmetic (its scales made per pair).
template <typename F, int R, int C>
IG_VNNI void SummedTile16(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                          int64_t c0, Panel panel, float* y, int64_t ldy) {
  const int64_t blocks = x.blocks, pairs = blocks / 2;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i q[C];
    __m256 dv[C];
    for (int c = 0; c < C; ++c) {
      const int64_t at = (c0 + c) * blocks + 2 * p;
      q[c] = PairValues16<F>(w, at, panel, c * x.k + 64 * p);
      dv[c] = PairScales8<F>(F::Scales(w) + at, 0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.Values(r0 + r) + 64 * p);
      const __m256 dxv = PairScales8<F>(x.Scales(r0 + r) + 2 * p, 0);
      for (int c = 0; c < C; ++c) {
        const __m512i dot16 = _mm512_dpbusd_epi32(F::Start16(xv), q[c], xv);
        const __m256i dot =
            _mm256_add_epi32(_mm512_castsi512_si256(dot16), _mm512_extracti64x4_epi64(dot16, 1));
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dxv), dv[c], acc[r][c]);
      }
    }
  }
  if (blocks % 2 == 1) AddOddBlock8<F, R, C>(x, r0, w, c0, panel, acc);
  AddMinimums8<F, R, C>(x, r0, w, c0, acc);
  AddTileSums<R, C>(acc, y, ldy);
}
#pragma GCC diagnostic pop

template <typename F>
struct Avx512Tiles {
  using Format = F;
  static constexpr int kRows = 4, kCols = 4, kGemvCols = 4;
  static constexpr bool kSpreadScales = false;  // 32 registers: its scales are made per pair
  template <int R, int C>
  static void Run(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w, int64_t c0,
                  Panel panel, float* y, int64_t ldy) {
    if constexpr (F::kSummedPairs) {
      SummedTile16<F, R, C>(x, r0, w, c0, panel, y, ldy);
    } else {
      Tile16<F, R, C>(x, r0, w, c0, panel, y, ldy);
    }
  }
};

}  // namespace

// The AVX-512 kernel's instructions: byte operations (BW, VL) and VNNI's dot products. An
// AVX-512 CPU without VNNI runs the AVX2 kernel (the same results).
bool CpuHasAvx512Vnni() {
  static const bool has = __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

template <typename F>
void ColumnBlockAvx512(const QuantizedRows& x, int64_t m, const typename F::Matrix& w, float* y,
                       int64_t ldy, int64_t cb) {
  RunColumnBlock<Avx512Tiles<F>>(x, m, w, y, ldy, cb);
}

#define IG_INSTANTIATE(F, M)                                                                   \
  template void ColumnBlockAvx512<F>(const QuantizedRows&, int64_t, const M&, float*, int64_t, \
                                     int64_t);
IG_INSTANTIATE(Nibbles<false>, Q4_1Matrix)
IG_INSTANTIATE(Nibbles<true>, Q5_1Matrix)
IG_INSTANTIATE(Signed8, Q8Matrix)
IG_INSTANTIATE(SixBits, Q6_KMatrix)
#undef IG_INSTANTIATE

}  // namespace infinigen::cpu::int8_dot
