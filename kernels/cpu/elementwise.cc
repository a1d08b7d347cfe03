// Row-wise and element-wise reference operations: embedding, norms, activations, softmax.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel_for.h"
#include "kernels/cpu/simd.h"

namespace infinigen::cpu {
namespace {
// Below this many elements the team's hand-off and join cost more than the work.
constexpr int64_t kParallelElements = 1 << 15;
}  // namespace

void Embedding(const float* table, int64_t dim, const int32_t* ids, int64_t n, float* out,
               int64_t out_stride) {
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out + i * out_stride, table + static_cast<int64_t>(ids[i]) * dim, dim * 4);
  }
}

void RmsNorm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t cols,
             float eps, float* out, int64_t out_stride) {
  ParallelFor(rows, rows * cols > kParallelElements, [&](int64_t r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    double sum_sq = 0.0;
    for (int64_t i = 0; i < cols; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum_sq / cols) + eps);
    for (int64_t i = 0; i < cols; ++i) o[i] = weight[i] * (xr[i] * inv);
  });
}

void LayerNorm(const float* x, int64_t x_stride, const float* weight, const float* bias,
               int64_t rows, int64_t cols, float eps, float* out, int64_t out_stride) {
  ParallelFor(rows, rows * cols > kParallelElements, [&](int64_t r) {
    const float* xr = x + r * x_stride;
    float* o = out + r * out_stride;
    double sum = 0.0;
    for (int64_t i = 0; i < cols; ++i) sum += xr[i];
    const double mean = sum / cols;
    double var = 0.0;
    for (int64_t i = 0; i < cols; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    const float inv = 1.0f / std::sqrt(static_cast<float>(var / cols) + eps);
    const float m = static_cast<float>(mean);
    for (int64_t i = 0; i < cols; ++i) {
      float y = (xr[i] - m) * inv;
      if (weight != nullptr) y *= weight[i];
      if (bias != nullptr) y += bias[i];
      o[i] = y;
    }
  });
}

void SwiGlu(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride,
            int64_t rows, int64_t cols, float* out, int64_t out_stride) {
  ParallelFor(rows, rows * cols > kParallelElements, [&](int64_t r) {
    const float* g = gate + r * gate_stride;
    const float* u = up + r * up_stride;
    float* o = out + r * out_stride;
    // g / (1 + exp(-g)) * u, 8 at a time; the tail through the same lanes.
    const auto silu_times = [](__m256 gv, __m256 uv) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), uv);
    };
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
      _mm256_storeu_ps(o + i, silu_times(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    }
    if (i < cols) {
      alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
      std::copy(g + i, g + cols, gt);
      std::copy(u + i, u + cols, ut);
      _mm256_store_ps(ot, silu_times(_mm256_load_ps(gt), _mm256_load_ps(ut)));
      std::copy(ot, ot + (cols - i), o + i);
    }
  });
}

void Relu(float* x, int64_t stride, int64_t rows, int64_t cols) {
  ParallelFor(rows, rows * cols > kParallelElements, [&](int64_t r) {
    float* xr = x + r * stride;
    for (int64_t i = 0; i < cols; ++i) xr[i] = std::max(xr[i], 0.0f);
  });
}

void Add(const float* x, int64_t x_stride, int64_t rows, int64_t cols, float* y, int64_t y_stride) {
  ParallelFor(rows, rows * cols > kParallelElements, [&](int64_t r) {
    const float* xr = x + r * x_stride;
    float* yr = y + r * y_stride;
    for (int64_t i = 0; i < cols; ++i) yr[i] += xr[i];
  });
}

void FillRandom(float* out, int64_t n, uint64_t seed, float scale, int64_t first) {
  ParallelFor(n, n > (1 << 20), [&](int64_t j) {
    const int64_t i = first + j;
    uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    out[j] = (static_cast<float>(z >> 40) * (1.0f / 8388608.0f) - 1.0f) * scale;
  });
}

void Softmax(float* x, int64_t n) {
  if (n <= 0) return;
  float max_v = x[0];
  for (int64_t i = 1; i < n; ++i) max_v = std::max(max_v, x[i]);
  if (max_v == -INFINITY) {  // everything masked: uniform is the only finite answer
    for (int64_t i = 0; i < n; ++i) x[i] = 1.0f / n;
    return;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_v);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace infinigen::cpu
