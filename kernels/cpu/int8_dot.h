// The int8 dot-product GEMM's parts that its two kernels share (int8_dot_gemm.cc: quantization,
// the AVX2 tiles and the entry points; int8_dot_avx512.cc: the AVX-512 VNNI tiles): the
// quantized x rows, the weight formats, the tiles' last steps and the loop over tiles. Internal
// to those two files. Both are compiled with the same flags, so that the inline pieces round
// alike in each.
//
// GemmRowsQ4_1, GemmRowsQ5_1, GemmRowsQ6_K and GemmRowsQ8 (row_gemm.h): block-quantized weights
// times activations quantized to 8 bits per block of 32, each block's dot product in integers
// (llama.cpp's way for its Q4, Q5 and Q8 formats; for Q6_K it quantizes activations per 256,
// we per 32 as for the others). Widening 4-, 5- or 8-bit values to float32
// takes more instructions than streaming them (the float32 kernels reached 18.5 GB/s for Q5_1,
// 22.4 for Q8 and 25.4 for Q4_1 on the project VM); integer dot products keep the GEMV
// memory-bound.
//
// Batch-invariant like the other GEMMs: each x row is quantized alone, and each output element
// is one fixed sequence of operations whatever the tile, the number of rows or the instruction
// set (the AVX-512 VNNI kernel and the AVX2 one give the same bits):
//   Q8 and Q6_K (scales that differ between a pair's two registers): per pair of blocks
//   (2p, 2p+1), 16 int32 lanes of 4-byte dot products in the format's pair order, each converted
//   to float, times its block's x scale, then acc = fma(that, its weight scale, acc) (the block's
//   d; Q6_K's d s of the lane's 16 weights); an odd last block's 8 lanes (elements in order) into
//   lanes 0-7 the same way; y += HorizontalSum(lanes 0-7 + lanes 8-15 of acc).
//   Q4_1 and Q5_1 (one scale per block, the same for both registers' lane j): per pair, 8 int32
//   lanes, lane j the sum of the two registers' lane j (integers: exact), converted to float,
//   times its block's x scale, then acc = fma(that, its block's d, acc) into 8 lanes; an odd last
//   block's 8 lanes the same way; then acc lane j = fma(m_b, xsum_b, acc) over blocks
//   b = j (mod 8) in order (m_b = -16 d_b or -8 d_b, exact, for a Q5_0 or Q4_0 matrix that keeps
//   no minimums); y += HorizontalSum(acc). (Half the float work of the 16 lanes.)
// Pair orders: the nibble formats (Q4_1, Q5_1, Q6_K), as a pair's 32 bytes of nibbles unpack: lanes
// 0-3 elements 0-15 of block 2p, 4-7 0-15 of 2p+1, 8-11 16-31 of 2p, 12-15 16-31 of 2p+1; Q8,
// its bytes in order: lanes 0-7 block 2p, 8-15 block 2p+1.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/packed_gemm.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/q4_1.h"
#include "kernels/cpu/q5_1.h"
#include "kernels/cpu/q6_k.h"
#include "kernels/cpu/simd.h"

#define IG_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace infinigen::cpu::int8_dot {

constexpr int64_t kBlock = 32;
static_assert(kQ4Block == kBlock && kQ5Block == kBlock && kQ6Block == kBlock && kQ8Block == kBlock);

// Output columns per parallel task, and x rows per pass over them (as row_gemm.cc's).
constexpr int64_t kColBlock = 48;
constexpr int64_t kRowBlock = 64;
// How far ahead of use a GEMV asks for weight bytes (row_gemm.cc's distance).
constexpr int64_t kPrefetchBytes = 2048;

// x rows quantized for the kernels. Per block b of 32 values of a row: dx[b] = max|x| / 127 (0
// for a block of zeros), q = round-to-nearest-even(x / dx) in [-127, 127], xsum[b] = dx[b] * the
// sum of q. The values of a pair of blocks (2p, 2p+1) lie in the weight format's pair order
// (the file's header): 64 bytes, for the nibble formats elements 0-15 of 2p, 0-15 of 2p+1,
// 16-31 of 2p, 16-31 of 2p+1; for Q8 in order. An odd last block's 32 lie in order.
struct QuantizedRows {
  const int8_t* q;
  const float* dx;
  const float* xsum;
  int64_t k;       // values per row
  int64_t blocks;  // per row
  // Per pair of blocks, its two scales spread as the AVX2 kernel's lanes take them (4 x dx[2p],
  // 4 x dx[2p+1]), so that they are a memory operand; null where not made (Quantize).
  const float* dx8 = nullptr;
  const int8_t* Values(int64_t r) const { return q + r * k; }
  const float* Spread(int64_t r) const { return dx8 + r * (blocks / 2) * 8; }
  const float* Scales(int64_t r) const { return dx + r * blocks; }
  const float* Sums(int64_t r) const { return xsum + r * blocks; }
};

// Pair p's two scales s[2p], s[2p+1] as 8 lanes (4 of each) at out + 8p: the nibble formats'
// lanes of a pair of blocks (PairScales8).
inline void SpreadPairScales(const float* s, int64_t pairs, float* out) {
  for (int64_t p = 0; p < pairs; ++p) {
    _mm256_storeu_ps(out + 8 * p,
                     _mm256_set_m128(_mm_set1_ps(s[2 * p + 1]), _mm_set1_ps(s[2 * p])));
  }
}

// HorizontalSum of each of four vectors, by the same additions in the same order.
inline __m128 FourHorizontalSums(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m128 s[4];
  const __m256 v[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    s[i] = _mm_add_ps(_mm256_castps256_ps128(v[i]), _mm256_extractf128_ps(v[i], 1));
  }
  // u01: lanes 0 + 2 and 1 + 3 of s[0], then of s[1] (HorizontalSum's second step).
  const __m128 u01 = _mm_add_ps(_mm_movelh_ps(s[0], s[1]), _mm_movehl_ps(s[1], s[0]));
  const __m128 u23 = _mm_add_ps(_mm_movelh_ps(s[2], s[3]), _mm_movehl_ps(s[3], s[2]));
  const __m128 even = _mm_shuffle_ps(u01, u23, _MM_SHUFFLE(2, 0, 2, 0));
  const __m128 odd = _mm_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 1, 3, 1));
  return _mm_add_ps(even, odd);
}

// y[c] += HorizontalSum(v[c]) for c < C: four at once by the same additions in the same order.
template <int C>
inline void AddHorizontalSums(const __m256 (&v)[C], float* y) {
  if constexpr (C == 4) {
    _mm_storeu_ps(y, _mm_add_ps(_mm_loadu_ps(y), FourHorizontalSums(v[0], v[1], v[2], v[3])));
  } else {
    for (int c = 0; c < C; ++c) y[c] += HorizontalSum(v[c]);
  }
}

// --- the formats --------------------------------------------------------------------------
//
// Each gives its values as bytes in its pair order: Pair8 (two AVX2 registers: bytes 0-31 and
// 32-63 of the pair), Pair16 (one AVX-512 register, as VNNI's unsigned operand) and Block8 (an
// odd last block); Dot8 (AVX2) and VNNI's `vpdpbusd` from the accumulator Start16 gives for the
// x bytes turn values and x bytes into the int32 lanes of the header. A panel (kPanel) holds
// Pair8's bytes, which must then be VNNI's unsigned operand as they are. Scales8 (AVX2, both
// registers of a pair) and Scales16 (AVX-512) give the weight scales of a pair's lanes; the
// formats with one scale per block take them from Scales(w) (PerBlockScales). Only formats
// with kOddBlock may end a row with an odd block (Block8).

// The bits of a pair of blocks' fifth-bit words (bit e: element e) in the order of the pair's
// bytes: bits 0-15 of the first word, 0-15 of the second, 16-31 of the first, 16-31 of the
// second.
inline uint64_t PairFifthBits(const uint32_t* qh) {
  const uint64_t u = qh[0] | (static_cast<uint64_t>(qh[1]) << 32);
  const uint64_t t = ((u >> 16) ^ u) & 0x00000000ffff0000ull;
  return u ^ (t | (t << 16));
}

// Byte j: 16 where bit j % 8 of byte `spread`[j] of v (within its 128-bit half) is set, else 0.
inline __m256i SixteensOfBits(__m256i v, __m256i spread) {
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201ll);
  const __m256i b = _mm256_shuffle_epi8(v, spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, select), select),
                          _mm256_set1_epi8(16));
}

// Byte j: 16 where bit j of `bits` is set, else 0.
inline __m256i FifthBits(uint32_t bits) {
  return SixteensOfBits(_mm256_set1_epi32(static_cast<int>(bits)),
                        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                         2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
}

// FifthBits of a pair's two registers (PairFifthBits' order) straight from its two words, in
// vector registers: register a takes bits 0-15 of each word (bytes 0-1 and 4-5 of the pair's
// 8 bytes), b bits 16-31 (bytes 2-3 and 6-7).
inline void PairFifthBits8(const uint32_t* qh, __m256i& fa, __m256i& fb) {
  long long words;
  std::memcpy(&words, qh, 8);
  const __m256i v = _mm256_set1_epi64x(words);
  fa = SixteensOfBits(v, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4,
                                          4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5));
  fb = SixteensOfBits(v, _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6, 6,
                                          6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7));
}

// The lanes' scales of the formats with one scale per block.
// (The matrix type is a template parameter: F is incomplete where it derives from this.)
template <typename F>
struct PerBlockScales {
  static constexpr bool kOddBlock = true;
  template <typename M>
  static void Scales8(const M& w, int64_t at, __m256 (&dv)[2]);
  template <typename M>
  IG_VNNI static __m512 Scales16(const M& w, int64_t at);
};

// Q4_1 (kFifth false) and Q5_1: unsigned values q (4 or 5 bits), w = d q + m per block.
template <bool kFifth>
struct Nibbles : PerBlockScales<Nibbles<kFifth>> {
  using Matrix = std::conditional_t<kFifth, Q5_1Matrix, Q4_1Matrix>;
  static constexpr bool kNibblePairs = true, kMinimums = true, kPanel = true, kSummedPairs = true;
  static const float* Scales(const Matrix& w) { return w.d; }
  static const float* Minimums(const Matrix& w) { return w.m; }
  // A minimum per unit of scale where the matrix keeps none (the file's Q5_0 and Q4_0).
  static constexpr float kCentered = kFifth ? kQ5Centered : kQ4Centered;
  static const uint8_t* Bytes(const Matrix& w, int64_t at) { return w.qs + at * (kBlock / 2); }

  static void Pair8(const Matrix& w, int64_t at, __m256i& qa, __m256i& qb, bool prefetch) {
    const uint8_t* bytes = Bytes(w, at);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    qa = _mm256_and_si256(nib, low);
    qb = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    if constexpr (kFifth) {
      __m256i fa, fb;
      PairFifthBits8(w.qh + at, fa, fb);
      qa = _mm256_or_si256(qa, fa);
      qb = _mm256_or_si256(qb, fb);
    }
  }
  static __m256i Block8(const Matrix& w, int64_t at) {
    const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Bytes(w, at)));
    const __m256i q =
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0f));
    if constexpr (kFifth) return _mm256_or_si256(q, FifthBits(w.qh[at]));
    return q;
  }
  // 8 int32 lanes, lane j the dot product of bytes 4j..4j+3 (q unsigned, x signed; a pair of
  // products is at most 2 * 31 * 127, inside int16).
  static __m256i Dot8(__m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
  }
  // The pair's 8 summed lanes (the header's): lane j = qa . xa + qb . xb over bytes 4j..4j+3 of
  // each register (x: the pair's 64 bytes). Each int16 is at most 2 * 31 * 127, the sum of the
  // two registers' at most 15748: inside int16, so the integers are exact.
  static __m256i DotPair8(__m256i qa, __m256i qb, const int8_t* x) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
    return _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(qa, xa), _mm256_maddubs_epi16(qb, xb)),
        _mm256_set1_epi16(1));
  }
  IG_VNNI static __m512i Pair16(const Matrix& w, int64_t at) {
    const uint8_t* bytes = Bytes(w, at);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m512i n = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1),
        _mm512_set1_epi8(0x0f));
    if constexpr (kFifth) {
      return _mm512_mask_add_epi8(n, _cvtu64_mask64(PairFifthBits(w.qh + at)), n,
                                  _mm512_set1_epi8(16));
    }
    return n;
  }
  IG_VNNI static __m512i Start16(__m512i) { return _mm512_setzero_si512(); }
};

// Q8 (packed_gemm.h): signed values q, w = d q. AVX2 multiplies |q| by x with q's sign; VNNI's
// unsigned operand is q + 128, and the accumulator starts at -128 times each lane's x bytes, so
// that both give the integers q . x.
struct Signed8 : PerBlockScales<Signed8> {
  using Matrix = Q8Matrix;
  // No panel: its bytes are signed, not VNNI's operand (and need no preparing).
  static constexpr bool kNibblePairs = false, kMinimums = false, kPanel = false,
                        kSummedPairs = false;
  static const float* Scales(const Matrix& w) { return w.scales; }
  static const float* Minimums(const Matrix&) { return nullptr; }
  static const int8_t* Bytes(const Matrix& w, int64_t at) { return w.qs + at * kBlock; }

  static void Pair8(const Matrix& w, int64_t at, __m256i& qa, __m256i& qb, bool prefetch) {
    const int8_t* bytes = Bytes(w, at);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32));
  }
  static __m256i Block8(const Matrix& w, int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Bytes(w, at)));
  }
  // |q| * (x with q's sign) = q x; a pair of products is at most 2 * 128 * 127, inside int16.
  static __m256i Dot8(__m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)),
                             _mm256_set1_epi16(1));
  }
  IG_VNNI static __m512i Pair16(const Matrix& w, int64_t at) {
    const int8_t* bytes = Bytes(w, at);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    return _mm512_xor_si512(_mm512_loadu_si512(bytes), _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  IG_VNNI static __m512i Start16(__m512i x) {
    return _mm512_sub_epi32(
        _mm512_setzero_si512(),
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(static_cast<char>(0x80)), x));
  }
};

// Q6_K (q6_k.h): unsigned 6-bit values q in the nibble formats' pair order, w = (d s) (q - 32)
// with s per 16 weights (4 lanes). AVX2 subtracts 32 times the x bytes from the products; VNNI's
// accumulator starts at -32 times each lane's x bytes: both give the integers (q - 32) . x.
struct SixBits {
  using Matrix = Q6_KMatrix;
  static constexpr bool kNibblePairs = true, kMinimums = false, kPanel = true, kOddBlock = false,
                        kSummedPairs = false;
  static const float* Minimums(const Matrix&) { return nullptr; }

  static void Pair8(const Matrix& w, int64_t at, __m256i& qa, __m256i& qb, bool prefetch) {
    const uint8_t* bytes = w.ql + at * (kBlock / 2);
    const uint8_t* high = w.qh + at * (kBlock / 4);
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(high) + kPrefetchBytes / 2, _MM_HINT_T0);
    }
    const __m256i low = _mm256_set1_epi8(0x0f), bits = _mm256_set1_epi8(0x30);
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(high));
    // Group g's two bits moved to bits 4-5 (a 16-bit shift moves other bits only into 0-3, 6-7).
    qa = _mm256_or_si256(
        _mm256_and_si256(nib, low),
        _mm256_and_si256(_mm256_set_m128i(_mm_slli_epi16(h, 2), _mm_slli_epi16(h, 4)), bits));
    qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), low),
                         _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(h, 2), h), bits));
  }
  // (q x - 32 x) per pair of bytes: at most 2 * 63 * 127 and 2 * 32 * 127, inside int16.
  static __m256i Dot8(__m256i q, __m256i x) {
    const __m256i qx = _mm256_maddubs_epi16(q, x);
    const __m256i offset = _mm256_maddubs_epi16(_mm256_set1_epi8(32), x);
    return _mm256_madd_epi16(_mm256_sub_epi16(qx, offset), _mm256_set1_epi16(1));
  }
  IG_VNNI static __m512i Pair16(const Matrix& w, int64_t at) {
    const uint8_t* bytes = w.ql + at * (kBlock / 2);
    const uint8_t* high = w.qh + at * (kBlock / 4);
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(high) + kPrefetchBytes / 2, _MM_HINT_T0);
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m512i n = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(nib), _mm256_srli_epi16(nib, 4), 1),
        _mm512_set1_epi8(0x0f));
    // 128-bit part g holds group g: its bits rotated to 4-5 (left 4, left 2, none, right 2).
    const __m512i h = _mm512_rorv_epi32(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high))),
        _mm512_setr_epi32(28, 28, 28, 28, 30, 30, 30, 30, 0, 0, 0, 0, 2, 2, 2, 2));
    return _mm512_or_si512(n, _mm512_and_si512(h, _mm512_set1_epi8(0x30)));
  }
  IG_VNNI static __m512i Start16(__m512i x) {
    return _mm512_sub_epi32(_mm512_setzero_si512(),
                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(32), x));
  }
  // The pair's four group scales d s (s converted to float, times d: exact in float32).
  static __m128 GroupScales(const Matrix& w, int64_t at) {
    int32_t four;
    std::memcpy(&four, w.s + 2 * at, 4);
    return _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four))),
                      _mm_set1_ps(w.d[at / 8]));
  }
  static void Scales8(const Matrix& w, int64_t at, __m256 (&dv)[2]) {
    const __m256 s = _mm256_castps128_ps256(GroupScales(w, at));
    dv[0] = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    dv[1] = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
  }
  IG_VNNI static __m512 Scales16(const Matrix& w, int64_t at) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(GroupScales(w, at)));
  }
};

// A task's weight rows prepared for several x rows (RunColumnBlock): the nibble formats' values, k
// bytes a row in pair order (row c at values + c * k; null: read from the matrix), and for Q4_1
// and Q5_1 each pair's scales spread as the AVX2 kernel's lanes take them (row c's pair p at
// scales + (c * pairs + p) * 8; null: made from the matrix's).
struct Panel {
  const uint8_t* values = nullptr;
  const float* scales = nullptr;
};

// Several x rows read each weight row many times: the nibble formats' values made once, in
// pair order, k bytes for each of `cols` weight rows from c0 (Q8's are its bytes already), and
// with `scales` (Q4_1, Q5_1) their pairs' scales spread (Panel).
template <typename F>
void PrepareColumns(const typename F::Matrix& w, int64_t c0, int64_t cols, uint8_t* out,
                    float* scales) {
  const int64_t blocks = w.cols / kBlock;
  for (int64_t c = 0; c < cols; ++c) {
    uint8_t* o = out + c * w.cols;
    const int64_t first = (c0 + c) * blocks;
    for (int64_t p = 0; p < blocks / 2; ++p) {
      __m256i qa, qb;
      F::Pair8(w, first + 2 * p, qa, qb, /*prefetch=*/false);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * p), qa);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * p + 32), qb);
    }
    if constexpr (F::kOddBlock) {
      if (blocks % 2 == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * (blocks - 1)),
                            F::Block8(w, first + blocks - 1));
      }
    }
    if constexpr (F::kMinimums) {  // the formats with one scale per block (Nibbles)
      if (scales != nullptr) {
        SpreadPairScales(F::Scales(w) + first, blocks / 2, scales + c * (blocks / 2) * 8);
      }
    }
  }
}

// An odd last block's values (at: the block's index in w; panel: null, or the weight row's
// prepared values) and their product with x row r's block b: 8 lanes of float(q . x) * dx, the
// header's step before the fma with d.
template <typename F>
inline __m256i OddBlockValues(const typename F::Matrix& w, int64_t at, const uint8_t* panel,
                              int64_t b) {
  return panel != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32 * b))
                          : F::Block8(w, at);
}
template <typename F>
inline __m256 OddBlockProduct(__m256i q, const QuantizedRows& x, int64_t r, int64_t b) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.Values(r) + 32 * b));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(F::Dot8(q, xv)), _mm256_set1_ps(x.Scales(r)[b]));
}

// --- the tiles' shared steps -------------------------------------------------------------

// The scales of a pair (v: its first block's) for AVX2 register h: the nibble formats' lanes
// 0-3 v[0] and 4-7 v[1] in both, Q8's v[h] in all.
template <typename F>
inline __m256 PairScales8(const float* v, int h) {
  if constexpr (F::kNibblePairs) return _mm256_set_m128(_mm_set1_ps(v[1]), _mm_set1_ps(v[0]));
  return _mm256_set1_ps(v[h]);
}

// The tiles' last steps, shared by the AVX2 and AVX-512 kernels (AVX2 instructions, inlined
// into either) so that both give the same bits: acc holds 8 lanes per output (the summed
// formats' accumulator; the others' two halves added).

// The odd last block: its elements in order, into lanes 0-7 of acc.
template <typename F, int R, int C>
inline void AddOddBlock8(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                         int64_t c0, Panel panel, __m256 (&acc)[R][C]) {
  const int64_t b = x.blocks - 1;
  for (int c = 0; c < C; ++c) {
    const int64_t at = (c0 + c) * x.blocks + b;
    const __m256i q =
        OddBlockValues<F>(w, at, panel.values != nullptr ? panel.values + c * x.k : nullptr, b);
    const __m256 dw = _mm256_set1_ps(F::Scales(w)[at]);
    for (int r = 0; r < R; ++r) {
      acc[r][c] = _mm256_fmadd_ps(OddBlockProduct<F>(q, x, r0 + r, b), dw, acc[r][c]);
    }
  }
}

// The summed formats' minimums: lane j += m_b xsum_b over blocks b = j (mod 8), in order. A
// matrix with no minimums (m null: the file's Q5_0 or Q4_0) has m_b = kCentered d_b, made here
// with the bits a stored one has (a power of two times d is exact).
template <typename F, int R, int C>
inline void AddMinimums8(const QuantizedRows& x, int64_t r0, const typename F::Matrix& w,
                         int64_t c0, __m256 (&acc)[R][C]) {
  const float* m = F::Minimums(w);
  const bool centered = m == nullptr;
  const float* from = centered ? F::Scales(w) : m;
  for (int64_t b = 0; b < x.blocks; b += 8) {
    const int64_t n = std::min<int64_t>(x.blocks - b, 8);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 mv[C];
    for (int c = 0; c < C; ++c) {
      mv[c] = _mm256_maskload_ps(from + (c0 + c) * x.blocks + b, lanes);
      if (centered) mv[c] = _mm256_mul_ps(mv[c], _mm256_set1_ps(F::kCentered));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sv = _mm256_maskload_ps(x.Sums(r0 + r) + b, lanes);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(mv[c], sv, acc[r][c]);
    }
  }
}

// y[r, c] += HorizontalSum(v[r][c]); two rows of two at once where the tile allows (the same
// additions in the same order).
template <int R, int C>
inline void AddTileSums(const __m256 (&v)[R][C], float* y, int64_t ldy) {
  if constexpr (C == 2 && R % 2 == 0) {
    for (int r = 0; r < R; r += 2) {
      float* y0 = y + r * ldy;
      const __m128 sums = FourHorizontalSums(v[r][0], v[r][1], v[r + 1][0], v[r + 1][1]);
      __m128 rows = _mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(y0));
      rows = _mm_loadh_pi(rows, reinterpret_cast<const __m64*>(y0 + ldy));
      rows = _mm_add_ps(rows, sums);
      _mm_storel_pi(reinterpret_cast<__m64*>(y0), rows);
      _mm_storeh_pi(reinterpret_cast<__m64*>(y0 + ldy), rows);
    }
  } else {
    for (int r = 0; r < R; ++r) AddHorizontalSums<C>(v[r], y + r * ldy);
  }
}

// The 16 lanes of a pair's scales (v: its first block's; v need not be 8-byte aligned): the
// nibble formats' lanes 0-3 and 8-11 v[0], 4-7 and 12-15 v[1]; Q8's 0-7 v[0], 8-15 v[1].
template <typename F>
IG_VNNI inline __m512 PairScales16(const float* v) {
  const __m512i pattern = F::kNibblePairs
                              ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                              : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i two = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v));
  return _mm512_permutexvar_ps(pattern, _mm512_castps128_ps512(_mm_castsi128_ps(two)));
}

template <typename F>
template <typename M>
void PerBlockScales<F>::Scales8(const M& w, int64_t at, __m256 (&dv)[2]) {
  for (int h = 0; h < 2; ++h) dv[h] = PairScales8<F>(F::Scales(w) + at, h);
}
template <typename F>
template <typename M>
IG_VNNI __m512 PerBlockScales<F>::Scales16(const M& w, int64_t at) {
  return PairScales16<F>(F::Scales(w) + at);
}

// --- the GEMM -----------------------------------------------------------------------------

template <typename K, int R>
void RunCols(const QuantizedRows& x, int64_t r0, const typename K::Format::Matrix& w, int64_t c0,
             int64_t cols, Panel panel, float* y, int64_t ldy) {
  if constexpr (K::kCols >= 6) {
    if (cols == 6) return K::template Run<R, 6>(x, r0, w, c0, panel, y, ldy);
    if (cols == 5) return K::template Run<R, 5>(x, r0, w, c0, panel, y, ldy);
  }
  if constexpr (K::kCols >= 4) {
    if (cols == 4) return K::template Run<R, 4>(x, r0, w, c0, panel, y, ldy);
    if (cols == 3) return K::template Run<R, 3>(x, r0, w, c0, panel, y, ldy);
  }
  if (cols == 2) return K::template Run<R, 2>(x, r0, w, c0, panel, y, ldy);
  return K::template Run<R, 1>(x, r0, w, c0, panel, y, ldy);
}

template <typename K>
void RunTile(const QuantizedRows& x, int64_t r0, int64_t rows, const typename K::Format::Matrix& w,
             int64_t c0, int64_t cols, Panel panel, float* y, int64_t ldy) {
  if constexpr (K::kRows >= 4) {
    if (rows == 4) return RunCols<K, 4>(x, r0, w, c0, cols, panel, y, ldy);
  }
  if constexpr (K::kRows >= 3) {
    if (rows == 3) return RunCols<K, 3>(x, r0, w, c0, cols, panel, y, ldy);
  }
  if (rows == 2) return RunCols<K, 2>(x, r0, w, c0, cols, panel, y, ldy);
  return RunCols<K, 1>(x, r0, w, c0, cols, panel, y, ldy);
}

// The output columns of a parallel task: kColBlock weight rows.
inline int64_t ColumnBlocks(int64_t rows) { return (rows + kColBlock - 1) / kColBlock; }

// Task cb of y += x w^T: weight rows [48 cb, 48 cb + 48). GEMV (one x row): one pass over the
// weights, each block's values made as they are read. More rows: the nibble formats' values of
// the task's weight rows made once into a panel (its 48 rows of k bytes stay in L2), then blocks
// of kRowBlock x rows multiplied by it, a group of weight rows at a time.
template <typename K>
void RunColumnBlock(const QuantizedRows& x, int64_t m, const typename K::Format::Matrix& w,
                    float* y, int64_t ldy, int64_t cb) {
  using F = typename K::Format;
  const int64_t n = w.rows;
  const bool gemv = m == 1, prepare = F::kPanel && !gemv;
  const bool spread = K::kSpreadScales && prepare && x.dx8 != nullptr;
  const int64_t step = gemv ? K::kGemvCols : K::kCols, pairs = w.cols / kBlock / 2;
  const int64_t j0 = cb * kColBlock, j1 = std::min(n, j0 + kColBlock);
  thread_local std::vector<uint8_t> panel;
  thread_local std::vector<float> panel_scales;
  if (prepare) {
    panel.resize(static_cast<size_t>(kColBlock * w.cols));
    if (spread) panel_scales.resize(static_cast<size_t>(kColBlock * pairs * 8));
    PrepareColumns<F>(w, j0, j1 - j0, panel.data(), spread ? panel_scales.data() : nullptr);
  }
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t i1 = std::min(m, i0 + kRowBlock);
    for (int64_t j = j0; j < j1; j += step) {
      const int64_t cols = std::min(step, j1 - j);
      Panel prepared;
      if (prepare) prepared.values = panel.data() + (j - j0) * w.cols;
      if (spread) prepared.scales = panel_scales.data() + (j - j0) * pairs * 8;
      for (int64_t i = i0; i < i1; i += K::kRows) {
        RunTile<K>(x, i, std::min<int64_t>(K::kRows, i1 - i), w, j, cols, prepared, y + i * ldy + j,
                   ldy);
      }
    }
  }
}

// Whether a GEMM of m rows by `rows` weight rows of k is worth the team.
inline bool WorthTheTeam(int64_t m, int64_t rows, int64_t k) { return m * rows * k > (1 << 16); }

// The GEMM's column blocks over the team, with stealing: each thread streams its contiguous
// share of the weights, and one that finishes first takes the blocks left at the end of the
// other's (the project VM's two threads run at unequal speeds; docs/benchmarks.md).
template <typename Body>
void ForColumnBlocks(int64_t blocks, bool parallel, const Body& body) {
  ParallelForStealing(blocks, parallel, body);
}

// The AVX-512 kernel (int8_dot_avx512.cc): whether this CPU has its instructions, and one task
// (RunColumnBlock) over its tiles for format F.
bool CpuHasAvx512Vnni();
template <typename F>
void ColumnBlockAvx512(const QuantizedRows& x, int64_t m, const typename F::Matrix& w, float* y,
                       int64_t ldy, int64_t cb);

}  // namespace infinigen::cpu::int8_dot
