#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel_for.h"

namespace infinigen::cpu {
namespace {

void RotatePair(float* head, int i, int half, RopeLayout layout, float c, float s) {
  float* a = layout == RopeLayout::kHalf ? head + i : head + 2 * i;
  float* b = layout == RopeLayout::kHalf ? head + i + half : head + 2 * i + 1;
  const float x0 = *a, x1 = *b;
  *a = x0 * c - x1 * s;
  *b = x1 * c + x0 * s;
}

}  // namespace

void Rope(float* x, int64_t stride, int64_t rows, int num_heads, int head_dim, int rotary_dim,
          const int32_t* positions, const float* inv_freq, RopeLayout layout,
          int64_t inv_freq_head_stride) {
  const int half = rotary_dim / 2;
  ParallelFor(rows, rows * num_heads * head_dim > (1 << 15), [&](int64_t r) {
    const float pos = static_cast<float>(positions[r]);
    if (inv_freq_head_stride == 0) {  // one angle per pair for every head
      for (int i = 0; i < half; ++i) {
        // float32 angle, as Hugging Face computes it, so long positions round the same way.
        const float angle = pos * inv_freq[i];
        const float c = std::cos(angle), s = std::sin(angle);
        for (int h = 0; h < num_heads; ++h) {
          RotatePair(x + r * stride + static_cast<int64_t>(h) * head_dim, i, half, layout, c, s);
        }
      }
      return;
    }
    for (int h = 0; h < num_heads; ++h) {
      for (int i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[h * inv_freq_head_stride + i];
        RotatePair(x + r * stride + static_cast<int64_t>(h) * head_dim, i, half, layout,
                   std::cos(angle), std::sin(angle));
      }
    }
  });
}

void ProjectHeads(const float* x, int64_t x_stride, int64_t rows, int num_heads, int num_kv_heads,
                  int head_dim, const float* skew, int partial_dim, float* out,
                  int64_t out_stride) {
  const int group = num_heads / num_kv_heads, p = partial_dim;
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < num_heads; ++h) {
      const float* xh = x + r * x_stride + static_cast<int64_t>(h) * head_dim;
      const float* a = skew + static_cast<int64_t>(h / group) * head_dim * p;
      float* o = out + r * out_stride + static_cast<int64_t>(h) * p;
      for (int c = 0; c < p; ++c) o[c] = 0.0f;
      for (int i = 0; i < head_dim; ++i) {
        const float xi = xh[i];
        const float* row = a + static_cast<int64_t>(i) * p;
        for (int c = 0; c < p; ++c) o[c] += xi * row[c];
      }
    }
  }
}

}  // namespace infinigen::cpu
