// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator. The random numbers for a token depend only on (seed, position), so a
// stream resumed on another worker draws exactly what the first one would have drawn.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define IG_HOST_DEVICE __host__ __device__
#else
#define IG_HOST_DEVICE
#endif

namespace infinigen {

struct Philox4x32 {
  uint32_t v[4];
};

IG_HOST_DEVICE inline Philox4x32 Philox4x32_10(uint64_t key, uint64_t counter_lo,
                                               uint64_t counter_hi) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// A uniform float in [0, 1) with 24 random bits, for the token at `position` of a stream
// seeded with `seed`. `stream` separates independent uses at the same position.
IG_HOST_DEVICE inline float UniformForPosition(uint64_t seed, uint64_t position,
                                               uint32_t stream = 0) {
  const Philox4x32 r = Philox4x32_10(seed, position, stream);
  return static_cast<float>(r.v[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace infinigen
