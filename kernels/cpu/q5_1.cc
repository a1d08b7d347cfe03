#include "kernels/cpu/q5_1.h"

#include <cmath>

namespace infinigen::cpu {

void WidenQ5_1Row(const Q5_1Matrix& w, int64_t r, float* out) {
  const int64_t blocks = w.cols / kQ5Block;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = r * blocks + b;
    const uint8_t* q = w.qs + at * (kQ5Block / 2);
    const uint32_t hi = w.qh[at];
    const float d = w.d[at], m = w.m != nullptr ? w.m[at] : kQ5Centered * d;
    float* o = out + b * kQ5Block;
    for (int64_t j = 0; j < kQ5Block / 2; ++j) {
      const uint32_t q0 = (q[j] & 0x0fu) | (((hi >> j) & 1u) << 4);
      const uint32_t q1 = (q[j] >> 4) | (((hi >> (j + 16)) & 1u) << 4);
      o[j] = std::fma(static_cast<float>(q0), d, m);
      o[j + kQ5Block / 2] = std::fma(static_cast<float>(q1), d, m);
    }
  }
}

void EmbeddingQ5_1(const Q5_1Matrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) WidenQ5_1Row(table, ids[i], out + i * out_stride);
}

}  // namespace infinigen::cpu
