// The int8 dot GEMM's AVX-512 VNNI kernel (the arithmetic int8_dot.h defines; the same bits
// as the AVX2 kernel of int8_dot_gemm.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/int8_dot.h"
#include "kernels/cpu/simd.h"

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
  if constexpr (C == 4 && R % 2 == 0) {  // two rows' eight sums folded together
    for (int r = 0; r < R; r += 2) {
      const __m512 a[8] = {acc[r][0],     acc[r][1],     acc[r][2],     acc[r][3],
                           acc[r + 1][0], acc[r + 1][1], acc[r + 1][2], acc[r + 1][3]};
      const __m256 eight = EightFoldedSums(a);
      float* y0 = y + r * ldy;
      _mm_storeu_ps(y0, _mm_add_ps(_mm_loadu_ps(y0), _mm256_castps256_ps128(eight)));
      _mm_storeu_ps(y0 + ldy, _mm_add_ps(_mm_loadu_ps(y0 + ldy), _mm256_extractf128_ps(eight, 1)));
    }
  } else {
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
}

// [lo | hi].
IG_VNNI inline __m512 Join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

// AddMinimums8 and AddTileSums for accumulators that hold two columns each ([column 2h's 8
// lanes | column 2h + 1's]): each lane's FMAs (zeros in the lanes past the last block, as
// AddMinimums8's masked loads give), then each column's HorizontalSum (EightHorizontalSums),
// added to y.
template <typename F, int R, int H>
IG_VNNI void PairedMinimumsAndSums(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                                   int64_t c0, __m512 (&acc)[R][H], float* y, int64_t ldy) {
  const float* m = F::Minimums(w);
  const bool centered = m == nullptr;
  const float* from = centered ? F::Scales(w) : m;
  for (int64_t b = 0; b < x.blocks; b += 8) {
    const int n = static_cast<int>(std::min<int64_t>(x.blocks - b, 8));
    const __mmask8 lanes = static_cast<__mmask8>((1u << n) - 1);
    __m512 mv[H];
    for (int h = 0; h < H; ++h) {
      const float* a = from + (c0 + 2 * h) * x.blocks + b;
      mv[h] = Join(_mm256_maskz_loadu_ps(lanes, a), _mm256_maskz_loadu_ps(lanes, a + x.blocks));
      if (centered) mv[h] = _mm512_mul_ps(mv[h], _mm512_set1_ps(F::kCentered));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s8 = _mm256_maskz_loadu_ps(lanes, x.Sums(r0 + r) + b);
      const __m512 sv = Join(s8, s8);
      for (int h = 0; h < H; ++h) acc[r][h] = _mm512_fmadd_ps(mv[h], sv, acc[r][h]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 pairs[4];  // a missing fourth is zeros, its sums dropped
    for (int p = 0; p < 4; ++p) pairs[p] = p < H ? acc[r][p] : _mm512_setzero_ps();
    const __m256 eight = EightHorizontalSums(pairs);
    float* yr = y + r * ldy;
    const __mmask8 mine = static_cast<__mmask8>((1u << (2 * H)) - 1);
    _mm256_mask_storeu_ps(yr, mine, _mm256_add_ps(_mm256_maskz_loadu_ps(mine, yr), eight));
  }
}

// The summed formats (Q4_1, Q5_1): SummedTile8's 8 lanes of a pair (VNNI's 16 lanes, their two
// halves added as integers), with SummedTile8's arithmetic from there on (its scales made per
// pair). Two columns share one register: [column c's 8 lanes | column c + 1's]. VNNI sums the
// halves itself: the first 32 bytes of both columns' pair, against x's first 32 twice, then the
// last 32 into the same lanes (the same integers). So each column pair takes two dot products
// and one 16-lane conversion, scaling and accumulation (every lane's operations are the 8-lane
// kernel's: the same bits). An odd last column runs alone in 8 lanes.
template <typename F, int R, int C>
IG_VNNI void SummedTile16(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                          int64_t c0, Panel panel, float* y, int64_t ldy) {
  constexpr int H = C / 2;  // column pairs
  constexpr bool kOddColumn = C % 2 == 1;
  const int64_t blocks = x.blocks, pairs = blocks / 2;
  // A pair's 2 block scales of column c and of c + 1 as 16 lanes (x row r's: PairScales16).
  const __m512i two_columns = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  auto two_floats = [](const float* v) {  // v need not be 8-byte aligned
    return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  };
  __m512 acc2[R][H > 0 ? H : 1];
  __m256 acc1[R];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < H; ++h) acc2[r][h] = _mm512_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  const float* ws = F::Scales(w);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i first[H > 0 ? H : 1], last[H > 0 ? H : 1], odd = _mm512_setzero_si512();
    __m512 dv2[H > 0 ? H : 1];
    __m256 dv1 = _mm256_setzero_ps();
    for (int h = 0; h < H; ++h) {
      const int c = 2 * h;
      const __m512i q0 = PairValues16<F>(w, (c0 + c) * blocks + 2 * p, panel, c * x.k + 64 * p);
      const __m512i q1 =
          PairValues16<F>(w, (c0 + c + 1) * blocks + 2 * p, panel, (c + 1) * x.k + 64 * p);
      first[h] = _mm512_shuffle_i64x2(q0, q1, 0x44);  // [q0 bytes 0-31 | q1 bytes 0-31]
      last[h] = _mm512_shuffle_i64x2(q0, q1, 0xEE);   // [q0 bytes 32-63 | q1 bytes 32-63]
      const float* a = ws + (c0 + c) * blocks + 2 * p;
      const __m128 four = _mm_loadh_pi(two_floats(a), reinterpret_cast<const __m64*>(a + blocks));
      dv2[h] = _mm512_permutexvar_ps(two_columns, _mm512_castps128_ps512(four));
    }
    if constexpr (kOddColumn) {
      odd = PairValues16<F>(w, (c0 + C - 1) * blocks + 2 * p, panel, (C - 1) * x.k + 64 * p);
      dv1 = PairScales8<F>(ws + (c0 + C - 1) * blocks + 2 * p, 0);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.Values(r0 + r) + 64 * p);
      const __m512 dx16 = PairScales16<F>(x.Scales(r0 + r) + 2 * p);  // [its 8 lanes, twice]
      if constexpr (H > 0) {
        const __m512i x_first = _mm512_shuffle_i64x2(xv, xv, 0x44);
        const __m512i x_last = _mm512_shuffle_i64x2(xv, xv, 0xEE);
        for (int h = 0; h < H; ++h) {
          const __m512i dot = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(F::Start16(xv), first[h], x_first), last[h], x_last);
          acc2[r][h] =
              _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), dx16), dv2[h], acc2[r][h]);
        }
      }
      if constexpr (kOddColumn) {
        const __m512i dot16 = _mm512_dpbusd_epi32(F::Start16(xv), odd, xv);
        const __m256i dot =
            _mm256_add_epi32(_mm512_castsi512_si256(dot16), _mm512_extracti64x4_epi64(dot16, 1));
        acc1[r] = _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm512_castps512_ps256(dx16)), dv1, acc1[r]);
      }
    }
  }
  if constexpr (!kOddColumn) {
    if (blocks % 2 == 0) {  // the common case: the last steps in 16 lanes too
      PairedMinimumsAndSums<F, R, H>(x, r0, w, c0, acc2, y, ldy);
      return;
    }
  }
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < H; ++h) {
      acc[r][2 * h] = _mm512_castps512_ps256(acc2[r][h]);
      acc[r][2 * h + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc2[r][h]), 1));
    }
    if constexpr (kOddColumn) acc[r][C - 1] = acc1[r];
  }
  if (blocks % 2 == 1) AddOddBlock8<F, R, C>(x, r0, w, c0, panel, acc);
  AddMinimums8<F, R, C>(x, r0, w, c0, acc);
  AddTileSums<R, C>(acc, y, ldy);
}
#pragma GCC diagnostic pop

template <typename F>
struct Avx512Tiles {
  using Format = F;
  // The summed formats' tiles are 4 x 6 (12 accumulators of two columns each; 3-4% faster
  // prefill than 4 x 4); the others' 4 x 4 (16).
  static constexpr int kRows = 4, kCols = F::kSummedPairs ? 6 : 4, kGemvCols = 4;
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
