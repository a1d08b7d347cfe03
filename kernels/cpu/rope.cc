#include <cmath>

#include "kernels/cpu/ops.h"

namespace infinigen::cpu {

void Rope(float* x, int64_t stride, int64_t rows, int num_heads, int head_dim, int rotary_dim,
          const int32_t* positions, const float* inv_freq, RopeLayout layout) {
  const int half = rotary_dim / 2;
#pragma omp parallel for if (rows * num_heads * head_dim > (1 << 15))
  for (int64_t r = 0; r < rows; ++r) {
    const float pos = static_cast<float>(positions[r]);
    for (int i = 0; i < half; ++i) {
      // float32 angle, as Hugging Face computes it, so long positions round the same way.
      const float angle = pos * inv_freq[i];
      const float c = std::cos(angle);
      const float s = std::sin(angle);
      for (int h = 0; h < num_heads; ++h) {
        float* head = x + r * stride + static_cast<int64_t>(h) * head_dim;
        float* a = layout == RopeLayout::kHalf ? head + i : head + 2 * i;
        float* b = layout == RopeLayout::kHalf ? head + i + half : head + 2 * i + 1;
        const float x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x1 * c + x0 * s;
      }
    }
  }
}

}  // namespace infinigen::cpu
