// GemmRowsQ4_1, GemmRowsQ5_1, GemmRowsQ6_K, GemmRowsQ8 and GemmRowsParts (row_gemm.h): the int8
// dot-product GEMM (int8_dot.h defines its arithmetic). This file: the x rows' quantization, the
// AVX2 kernel, and the choice between it and the AVX-512 one (int8_dot_avx512.cc).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cfloat>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <variant>
#include <vector>

#include "kernels/cpu/int8_dot.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/row_gemm.h"

namespace infinigen::cpu {
using namespace int8_dot;  // the parts this file implements the kernel with
namespace {

// One block of 32 values quantized (AVX2; the arithmetic QuantizedRows defines: a max, one IEEE
// division and multiply, and the default rounding of the conversion). Writes elements 0-15 to
// lo and 16-31 to hi, and returns the sum of the values. A block holding a NaN or an infinity
// gets a NaN scale (and zeros), so that every output it touches is NaN, as a float32 product's
// would be NaN or infinite (an infinity's scale would quantize it to -128 by way of inf * 0).
inline int QuantizeBlock(const float* x, float& dx, int8_t* lo, int8_t* hi) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 largest = _mm256_set1_ps(FLT_MAX);
  __m256 v[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int s = 0; s < 4; ++s) {
    v[s] = _mm256_loadu_ps(x + 8 * s);
    const __m256 a = _mm256_andnot_ps(sign, v[s]);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // NaN or infinite
  }
  if (_mm256_movemask_ps(bad) != 0) {
    dx = std::numeric_limits<float>::quiet_NaN();
    std::memset(lo, 0, 16);
    std::memset(hi, 0, 16);
    return 0;
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max = _mm_cvtss_f32(m4);
  dx = max / 127.0f;
  // A block too small for a finite reciprocal of its scale quantizes to zeros.
  const __m256 inv = _mm256_set1_ps(dx >= FLT_MIN ? 1.0f / dx : 0.0f);
  __m256i q[4];
  for (int s = 0; s < 4; ++s) q[s] = _mm256_cvtps_epi32(_mm256_mul_ps(v[s], inv));
  const __m256i total =
      _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  // int32 -> int8 (in range: no saturation), lanes back in element order.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(bytes, 1));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// xsum may be null (Q8 weights need no sums).
void QuantizeRow(const float* x, int64_t k, bool nibble_pairs, int8_t* q, float* dx, float* xsum) {
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t p = b / 2;
    int8_t *lo, *hi;
    if (nibble_pairs && 2 * p + 1 < blocks) {  // one of a pair, interleaved with the other
      lo = q + 64 * p + 16 * (b % 2);
      hi = lo + 32;
    } else {  // in order
      lo = q + 32 * b;
      hi = lo + 16;
    }
    const int sum = QuantizeBlock(x + b * kBlock, dx[b], lo, hi);
    if (xsum != nullptr) xsum[b] = dx[b] * static_cast<float>(sum);
  }
}

// The m rows of x quantized into buffers of the calling thread (the parallel tasks read them),
// set `slot` of two (GemmRowsParts quantizes x in both layouts); with `spread`, their scales
// spread too (QuantizedRows::dx8).
QuantizedRows Quantize(const float* x, int64_t ldx, int64_t m, int64_t k, bool nibble_pairs,
                       bool spread, int slot = 0) {
  struct Buffers {
    std::vector<int8_t> q;
    std::vector<float> dx, xsum, dx8;
  };
  thread_local Buffers buffers[2];
  auto& [q, dx, xsum, dx8] = buffers[slot];
  const int64_t blocks = k / kBlock, pairs = blocks / 2;
  if (static_cast<int64_t>(q.size()) < m * k) q.resize(m * k);
  if (static_cast<int64_t>(dx.size()) < m * blocks) {
    dx.resize(m * blocks);
    xsum.resize(m * blocks);
  }
  if (spread && static_cast<int64_t>(dx8.size()) < m * pairs * 8) dx8.resize(m * pairs * 8);
  int8_t* qp = q.data();
  float *dp = dx.data(), *sp = xsum.data(), *d8 = dx8.data();
  ParallelFor(m, m >= 16, [&](int64_t r) {
    QuantizeRow(x + r * ldx, k, nibble_pairs, qp + r * k, dp + r * blocks, sp + r * blocks);
    if (spread) SpreadPairScales(dp + r * blocks, pairs, d8 + r * pairs * 8);
  });
  return {qp, dp, sp, k, blocks, spread ? d8 : nullptr};
}

// --- AVX2 ---------------------------------------------------------------------------------

// y[r, c] += x_r . w_c for r < R, c < C, in the order the file's header gives: Q8 and Q6_K,
// 16 lanes in two halves.
template <typename F, int R, int C>
void Tile8(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w, int64_t c0, Panel panel,
           float* y, int64_t ldy) {
  static_assert(!F::kMinimums);
  const int64_t blocks = x.blocks, pairs = blocks / 2;
  __m256 acc[2][R][C];
  for (int h = 0; h < 2; ++h) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[h][r][c] = _mm256_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i q[C][2];
    __m256 dv[C][2];
    for (int c = 0; c < C; ++c) {
      const int64_t at = (c0 + c) * blocks + 2 * p;
      if (panel.values != nullptr) {
        const uint8_t* v = panel.values + c * x.k + 64 * p;
        q[c][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
        q[c][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32));
      } else {
        F::Pair8(w, at, q[c][0], q[c][1], /*prefetch=*/true);
      }
      F::Scales8(w, at, dv[c]);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.Values(r0 + r) + 64 * p;
      for (int h = 0; h < 2; ++h) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * h));
        const __m256 dxv = PairScales8<F>(x.Scales(r0 + r) + 2 * p, h);
        for (int c = 0; c < C; ++c) {
          acc[h][r][c] = _mm256_fmadd_ps(
              _mm256_mul_ps(_mm256_cvtepi32_ps(F::Dot8(q[c][h], xv)), dxv), dv[c][h], acc[h][r][c]);
        }
      }
    }
  }
  if constexpr (F::kOddBlock) {
    if (blocks % 2 == 1) AddOddBlock8<F, R, C>(x, r0, w, c0, panel, acc[0]);
  } else {
    assert(blocks % 2 == 0);
  }
  __m256 v[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) v[r][c] = _mm256_add_ps(acc[0][r][c], acc[1][r][c]);
  }
  AddTileSums<R, C>(v, y, ldy);
}

// The summed formats' pairs (Q4_1, Q5_1): one 8-lane accumulator per output. kSpread: both
// scales spread (Panel::scales, QuantizedRows::dx8) and read as memory operands, which leaves
// the registers to the accumulators and values.
template <typename F, int R, int C, bool kSpread>
inline void SummedPairs8(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                         int64_t c0, Panel panel, __m256 (&acc)[R][C]) {
  const int64_t blocks = x.blocks, pairs = blocks / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m256i q[C][2];
    __m256 dv[C];
    for (int c = 0; c < C; ++c) {
      const int64_t at = (c0 + c) * blocks + 2 * p;
      if (panel.values != nullptr) {
        const uint8_t* v = panel.values + c * x.k + 64 * p;
        q[c][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
        q[c][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32));
      } else {
        F::Pair8(w, at, q[c][0], q[c][1], /*prefetch=*/true);
      }
      if constexpr (!kSpread) dv[c] = PairScales8<F>(F::Scales(w) + at, 0);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xq = x.Values(r0 + r) + 64 * p;
      const __m256 dxv = kSpread ? _mm256_loadu_ps(x.Spread(r0 + r) + 8 * p)
                                 : PairScales8<F>(x.Scales(r0 + r) + 2 * p, 0);
      for (int c = 0; c < C; ++c) {
        const __m256 dw = kSpread ? _mm256_loadu_ps(panel.scales + (c * pairs + p) * 8) : dv[c];
        acc[r][c] = _mm256_fmadd_ps(
            _mm256_mul_ps(_mm256_cvtepi32_ps(F::DotPair8(q[c][0], q[c][1], xq)), dxv), dw,
            acc[r][c]);
      }
    }
  }
}

// y[r, c] += x_r . w_c for the summed formats (the header's order).
template <typename F, int R, int C>
void SummedTile8(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w, int64_t c0,
                 Panel panel, float* y, int64_t ldy) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  if (panel.scales != nullptr && x.dx8 != nullptr) {
    SummedPairs8<F, R, C, true>(x, r0, w, c0, panel, acc);
  } else {
    SummedPairs8<F, R, C, false>(x, r0, w, c0, panel, acc);
  }
  if (x.blocks % 2 == 1) AddOddBlock8<F, R, C>(x, r0, w, c0, panel, acc);
  AddMinimums8<F, R, C>(x, r0, w, c0, acc);
  AddTileSums<R, C>(acc, y, ldy);
}

template <typename F>
struct Avx2Tiles {
  using Format = F;
  // The summed formats' tile holds 8 accumulators as 4 x 2 (the others' 2 x 2 of two halves).
  static constexpr int kRows = F::kSummedPairs ? 4 : 2, kCols = 2, kGemvCols = 2;
  // Panel::scales and QuantizedRows::dx8 for the summed formats (Q4_1, Q5_1).
  static constexpr bool kSpreadScales = F::kSummedPairs;
  template <int R, int C>
  static void Run(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w, int64_t c0,
                  Panel panel, float* y, int64_t ldy) {
    if constexpr (F::kSummedPairs) {
      SummedTile8<F, R, C>(x, r0, w, c0, panel, y, ldy);
    } else {
      Tile8<F, R, C>(x, r0, w, c0, panel, y, ldy);
    }
  }
};

template <typename M>
struct FormatOf;
template <>
struct FormatOf<Q8Matrix> {
  using type = Signed8;
};
template <>
struct FormatOf<Q4_1Matrix> {
  using type = Nibbles<false>;
};
template <>
struct FormatOf<Q5_1Matrix> {
  using type = Nibbles<true>;
};
template <>
struct FormatOf<Q6_KMatrix> {
  using type = SixBits;
};

// Task cb of one part of GemmRowsParts, its matrix's type erased.
using PartTask = void (*)(const QuantizedRows& x, int64_t m, const void* w, float* y, int64_t ldy,
                          int64_t cb);
template <typename F, bool kAvx512>
void RunPartBlock(const QuantizedRows& x, int64_t m, const void* w, float* y, int64_t ldy,
                  int64_t cb) {
  const auto& matrix = *static_cast<const typename F::Matrix*>(w);
  if constexpr (kAvx512) {
    ColumnBlockAvx512<F>(x, m, matrix, y, ldy, cb);
  } else {
    RunColumnBlock<Avx2Tiles<F>>(x, m, matrix, y, ldy, cb);
  }
}

// A single-format GEMM: GemmRowsParts with one part.
template <typename M>
void OnePart(const float* x, int64_t ldx, const M& w, const float* bias, float* y, int64_t ldy,
             int64_t m, bool accumulate) {
  const BlockPart part{w, bias, y};
  GemmRowsParts(x, ldx, {&part, 1}, ldy, m, accumulate);
}

}  // namespace

void GemmRowsParts(const float* x, int64_t ldx, std::span<const BlockPart> parts, int64_t ldy,
                   int64_t m, bool accumulate) {
  if (m <= 0 || parts.empty()) return;
  if (parts.size() > kMaxBlockParts) {
    for (const BlockPart& part : parts) GemmRowsParts(x, ldx, {&part, 1}, ldy, m, accumulate);
    return;
  }
  const bool avx512 = ActiveIsa() == Isa::kAvx512 && CpuHasAvx512Vnni();
  // Each part's tasks follow the previous part's: part i's are [first, first + its blocks).
  struct Entry {
    PartTask run;
    const void* w;
    float* y;
    int64_t first;
    int layout;  // 0: x in the nibble formats' pair order, 1: in order (Q8)
  };
  std::array<Entry, kMaxBlockParts> entries;
  bool needs[2] = {false, false}, spread = false;
  int64_t k = -1, rows = 0, tasks = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::visit(
        [&](const auto& w) {
          using F = typename FormatOf<std::decay_t<decltype(w)>>::type;
          assert(w.cols % kBlock == 0 && (k < 0 || w.cols == k));
          if constexpr (std::is_same_v<F, SixBits>) assert(w.cols % kQ6Super == 0);
          k = w.cols;
          InitGemmOutput(parts[i].bias, parts[i].y, ldy, m, w.rows, accumulate);
          const int layout = F::kNibblePairs ? 0 : 1;
          needs[layout] = true;
          // Spread scales are read only by the tiles that take them (kSpreadScales).
          spread = spread || (!avx512 && Avx2Tiles<F>::kSpreadScales && m > 1);
          PartTask run = avx512 ? &RunPartBlock<F, true> : &RunPartBlock<F, false>;
          entries[i] = {run, &w, parts[i].y, tasks, layout};
          tasks += ColumnBlocks(w.rows);
          rows += w.rows;
        },
        parts[i].matrix);
  }
  std::array<QuantizedRows, 2> xq{};
  if (needs[0]) xq[0] = Quantize(x, ldx, m, k, /*nibble_pairs=*/true, spread, /*slot=*/0);
  if (needs[1]) xq[1] = Quantize(x, ldx, m, k, /*nibble_pairs=*/false, false, /*slot=*/1);
  const size_t count = parts.size();
  ForColumnBlocks(tasks, WorthTheTeam(m, rows, k), [&](int64_t cb) {
    size_t i = 0;
    while (i + 1 < count && entries[i + 1].first <= cb) ++i;
    const Entry& e = entries[i];
    e.run(xq[e.layout], m, e.w, e.y, ldy, cb - e.first);
  });
}

// Weights quantize as x rows do, in order (packed_gemm.h's layout): the same arithmetic.
void QuantizeQ8(const float* w, int64_t rows, int64_t cols, int8_t* qs, float* scales) {
  const int64_t blocks = cols / kBlock;
  ParallelFor(rows, rows * cols > (1 << 16), [&](int64_t r) {
    QuantizeRow(w + r * cols, cols, /*nibble_pairs=*/false, qs + r * cols, scales + r * blocks,
                nullptr);
  });
}

void GemmRowsQ4_1(const float* x, int64_t ldx, const Q4_1Matrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate) {
  OnePart(x, ldx, w, bias, y, ldy, m, accumulate);
}

void GemmRowsQ5_1(const float* x, int64_t ldx, const Q5_1Matrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate) {
  OnePart(x, ldx, w, bias, y, ldy, m, accumulate);
}

void GemmRowsQ6_K(const float* x, int64_t ldx, const Q6_KMatrix& w, const float* bias, float* y,
                  int64_t ldy, int64_t m, bool accumulate) {
  assert(w.cols % kQ6Super == 0);
  OnePart(x, ldx, w, bias, y, ldy, m, accumulate);
}

void GemmRowsQ8(const float* x, int64_t ldx, const Q8Matrix& w, const float* bias, float* y,
                int64_t ldy, int64_t m, bool accumulate) {
  OnePart(x, ldx, w, bias, y, ldy, m, accumulate);
}

}  // namespace infinigen::cpu
