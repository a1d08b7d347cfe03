// Reference attention. Prefill runs per head as two GEMMs over blocks of query rows (the
// scores of one block are the only scratch); decode walks an explicit row list per KV head.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/ops.h"

namespace infinigen::cpu {
namespace {

// Query rows per block in AttentionCausal: bounds the score scratch to kQueryBlock × context.
constexpr int64_t kQueryBlock = 128;

// Per-thread scratch that only grows, so steady-state calls allocate nothing.
float* Scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace

void AttentionCausal(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                     KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                     float* out, int64_t out_stride) {
  const int group = num_heads / num_kv_heads;
  for (int h = 0; h < num_heads; ++h) {
    const int g = h / group;
    const float* kh = k.data + g * k.head_stride;
    const float* vh = v.data + g * v.head_stride;
    for (int64_t b0 = 0; b0 < num_q; b0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, num_q - b0);
      const int64_t ctx = q_start + b0 + rows;  // keys visible to the block's last row
      float* s = Scratch(rows * ctx);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ctx, head_dim, scale,
                  q + b0 * q_stride + h * head_dim, q_stride, kh, k.row_stride, 0.0f, s, ctx);
#pragma omp parallel for if (rows * ctx > (1 << 15))
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * ctx;
        const int64_t visible = q_start + b0 + r + 1;
        std::fill(sr + visible, sr + ctx, 0.0f);
        Softmax(sr, visible);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, ctx, 1.0f, s, ctx, vh,
                  v.row_stride, 0.0f, out + b0 * out_stride + h * head_dim, out_stride);
    }
  }
}

void AttentionDecode(const float* q, KvRows k, KvRows v, const int32_t* indices, int64_t num_rows,
                     int num_heads, int num_kv_heads, int head_dim, float scale, float* out,
                     float* weights_out) {
  const int group = num_heads / num_kv_heads;
#pragma omp parallel for if (num_rows * num_heads * head_dim > (1 << 16))
  for (int h = 0; h < num_heads; ++h) {
    const int g = h / group;
    const int32_t* idx = indices != nullptr ? indices + g * num_rows : nullptr;
    const float* qh = q + h * head_dim;
    float* s = Scratch(num_rows);
    for (int64_t j = 0; j < num_rows; ++j) {
      const float* kr = k.Row(g, idx != nullptr ? idx[j] : j);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
      s[j] = dot * scale;
    }
    Softmax(s, num_rows);
    if (weights_out != nullptr) std::copy_n(s, num_rows, weights_out + h * num_rows);
    float* oh = out + h * head_dim;
    std::fill(oh, oh + head_dim, 0.0f);
    for (int64_t j = 0; j < num_rows; ++j) {
      const float* vr = v.Row(g, idx != nullptr ? idx[j] : j);
      const float p = s[j];
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) oh[d] += p * vr[d];
    }
  }
}

}  // namespace infinigen::cpu
