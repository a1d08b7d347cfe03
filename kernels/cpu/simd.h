// The small vector pieces the CPU kernels share: bfloat16 widened exactly to float32, 8 or 16 at
// a time, and the one horizontal sum of 8 lanes. Internal to kernels/cpu (x86-64-v3; the 16-lane
// form only where ActiveIsa() allows AVX-512).
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

}  // namespace infinigen::cpu
