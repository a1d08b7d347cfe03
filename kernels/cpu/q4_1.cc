#include "kernels/cpu/q4_1.h"

#include <algorithm>
#include <cmath>

#include "common/dtype.h"
#include "kernels/cpu/parallel_for.h"

namespace infinigen::cpu {

void QuantizeQ4_1(const float* w, int64_t rows, int64_t cols, uint8_t* qs, float* d, float* m) {
  const int64_t blocks = cols / kQ4Block;
  ParallelFor(rows, rows * cols > (1 << 16), [&](int64_t r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = w + r * cols + b * kQ4Block;
      const int64_t at = r * blocks + b;
      float lo = src[0], hi = src[0];
      for (int64_t i = 1; i < kQ4Block; ++i) {
        lo = std::min(lo, src[i]);
        hi = std::max(hi, src[i]);
      }
      d[at] = HalfToFloat(FloatToHalf((hi - lo) / 15.0f));
      m[at] = HalfToFloat(FloatToHalf(lo));
      const float scale = d[at], min = m[at];
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      uint8_t* dst = qs + at * (kQ4Block / 2);
      for (int64_t j = 0; j < kQ4Block / 2; ++j) {
        auto q = [&](float x) {
          return static_cast<uint8_t>(std::clamp(std::lrintf((x - min) * inv), 0L, 15L));
        };
        dst[j] = static_cast<uint8_t>(q(src[j]) | (q(src[j + kQ4Block / 2]) << 4));
      }
    }
  });
}

void WidenQ4_1Row(const Q4_1Matrix& w, int64_t r, float* out) {
  const int64_t blocks = w.cols / kQ4Block;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = r * blocks + b;
    const uint8_t* q = w.qs + at * (kQ4Block / 2);
    const float d = w.d[at], m = w.m != nullptr ? w.m[at] : kQ4Centered * d;
    float* o = out + b * kQ4Block;
    for (int64_t j = 0; j < kQ4Block / 2; ++j) {
      o[j] = std::fma(static_cast<float>(q[j] & 0x0f), d, m);
      o[j + kQ4Block / 2] = std::fma(static_cast<float>(q[j] >> 4), d, m);
    }
  }
}

void EmbeddingQ4_1(const Q4_1Matrix& table, const int32_t* ids, int64_t n, float* out,
                   int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) WidenQ4_1Row(table, ids[i], out + i * out_stride);
}

}  // namespace infinigen::cpu
