// The small vector pieces the CPU kernels share: bfloat16 widened exactly to float32, 8 or 16 at
// a time, the one horizontal sum of 8 lanes (and eight of them at once), and exp of 8 lanes.
// Internal to kernels/cpu (x86-64-v3; the 16-lane form only where ActiveIsa() allows AVX-512).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/isa.h"

namespace infinigen::cpu {

// 8 bfloat16 values at p as float32 (exact: the bits shifted into the high half).
inline __m256 WidenBf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 16 bfloat16 values at p as float32, lanes 0-7 and 8-15 as two WidenBf16x8 give them.
IG_AVX512 inline __m512 WidenBf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 8 lanes of v summed as ((0+4)+(2+6))+((1+5)+(3+7)): every kernel that reduces a row's
// products goes through this one order.
inline float HorizontalSum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// GCC 12's AVX-512 headers build some results from _mm512_undefined_* values, which it then
// reports as uninitialized where they are inlined (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// HorizontalSum of eight 8-lane vectors held two to a register (pairs[p]: [vector 2p | vector
// 2p + 1]), by HorizontalSum's additions in its order: lane i of the result is vector i's sum.
IG_AVX512 inline __m256 EightHorizontalSums(const __m512 (&pairs)[4]) {
  __m512 quads[2];  // 128-bit lane r: lanes 0-3 + 4-7 of vector 4q + r
  for (int q = 0; q < 2; ++q) {
    quads[q] = _mm512_add_ps(
        _mm512_shuffle_f32x4(pairs[2 * q], pairs[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
        _mm512_shuffle_f32x4(pairs[2 * q], pairs[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // 128-bit lane r: [0 + 2, 1 + 3 of vector r, 0 + 2, 1 + 3 of vector r + 4].
  const __m512 halves =
      _mm512_add_ps(_mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_ps(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lane r: [sum r, sum r, sum r + 4, sum r + 4] (x + y and y + x are the same float).
  const __m512 sums =
      _mm512_add_ps(halves, _mm512_shuffle_ps(halves, halves, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}

// HorizontalSum(lanes 0-7 + lanes 8-15) of each of eight 16-lane accumulators (how the 16-lane
// kernels end a dot product), by the same additions in the same order: the halves added
// (accumulators in pairs), then EightHorizontalSums.
IG_AVX512 inline __m256 EightFoldedSums(const __m512 (&a)[8]) {
  __m512 pairs[4];  // [lanes 0-7 + 8-15 of a[2p] | of a[2p + 1]]
  for (int p = 0; p < 4; ++p) {
    pairs[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return EightHorizontalSums(pairs);
}
#pragma GCC diagnostic pop

// exp(x), 8 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r,
// times 2^n; within 2 ulp of the exact value) for x in [-87.33654, 88]; below, the smallest
// normal float (1.2e-38) instead of smaller values or 0, above, exp(88) = 1.65e38 instead of
// larger values or infinity; a NaN lane as -87.33654. Each lane depends only on its own input.
inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n from the exponent bits: n in [-126, 127] here, a normal float.
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace infinigen::cpu
