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

// Rows listed by index are scattered: ask for the row kAhead positions ahead while working on
// this one, so that several misses are in flight (hardware prefetchers do not follow indices).
constexpr int64_t kAhead = 8;
// Rows per decode task (see AttentionDecode).
constexpr int64_t kDecodeChunk = 256;
inline void Prefetch(const float* row, int head_dim) {
  for (int d = 0; d < head_dim; d += 16) __builtin_prefetch(row + d);  // a cache line per 16
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

void AttentionCausalRows(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                         KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                         float* out, int64_t out_stride) {
  // Each query row exactly as a decode step computes it (AttentionDecode over the rows it sees,
  // whose chunking and merge order do not depend on threads); rows in parallel, each on one
  // thread (the nested region of AttentionDecode runs with a team of one).
#pragma omp parallel for schedule(dynamic, 1) if (num_q > 1)
  for (int64_t r = 0; r < num_q; ++r) {
    AttentionDecode(q + r * q_stride, k, v, nullptr, q_start + r + 1, num_heads, num_kv_heads,
                    head_dim, scale, out + r * out_stride);
  }
}

// Decode attention, split like flash-decoding: the rows of each KV head are cut into chunks of
// kDecodeChunk, and one task per (KV head, chunk) reads each K and V row once for every query
// head of the group (a row read per query head made the dense case read K and V group times),
// keeping per query head the chunk's max score, its sum of exponentials and its unnormalized
// output; the chunks are then merged exactly (each rescaled by exp(chunk max - max)). Tasks run
// in parallel, so a few KV heads over many rows still use every core.
void AttentionDecode(const float* q, KvRows k, KvRows v, const int32_t* indices, int64_t num_rows,
                     int num_heads, int num_kv_heads, int head_dim, float scale, float* out,
                     float* weights_out) {
  const int group = num_heads / num_kv_heads;
  if (num_rows <= 0) {
    std::fill(out, out + static_cast<int64_t>(num_heads) * head_dim, 0.0f);
    return;
  }
  const int64_t chunks = (num_rows + kDecodeChunk - 1) / kDecodeChunk;
  const int64_t tasks = chunks * num_kv_heads;
  // Scratch of the calling thread: scores [heads, rows] (then exp(score - chunk max)), and per
  // (query head, chunk) the max, the sum and the output [head_dim].
  float* scratch = Scratch(static_cast<size_t>(num_heads) *
                           (num_rows + chunks * (2 + static_cast<int64_t>(head_dim))));
  float* scores = scratch;
  float* chunk_max = scores + static_cast<int64_t>(num_heads) * num_rows;
  float* chunk_sum = chunk_max + num_heads * chunks;
  float* chunk_out = chunk_sum + num_heads * chunks;
#pragma omp parallel for schedule(static) if (num_rows * num_heads * head_dim > (1 << 16))
  for (int64_t t = 0; t < tasks; ++t) {
    const int g = static_cast<int>(t / chunks);
    const int64_t c = t % chunks;
    const int64_t j0 = c * kDecodeChunk, j1 = std::min(num_rows, j0 + kDecodeChunk);
    const int32_t* idx = indices != nullptr ? indices + g * num_rows : nullptr;
    const int h0 = g * group;
    for (int64_t j = j0; j < j1; ++j) {
      const float* kr = k.Row(g, idx != nullptr ? idx[j] : j);
      if (idx != nullptr && j + kAhead < j1) Prefetch(k.Row(g, idx[j + kAhead]), head_dim);
      for (int h = h0; h < h0 + group; ++h) {
        const float* qh = q + h * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
        scores[h * num_rows + j] = dot * scale;
      }
    }
    for (int h = h0; h < h0 + group; ++h) {
      float* s = scores + h * num_rows;
      float m = -INFINITY;
      for (int64_t j = j0; j < j1; ++j) m = std::max(m, s[j]);
      double sum = 0.0;
      for (int64_t j = j0; j < j1; ++j) {
        s[j] = m == -INFINITY ? 0.0f : std::exp(s[j] - m);
        sum += s[j];
      }
      chunk_max[h * chunks + c] = m;
      chunk_sum[h * chunks + c] = static_cast<float>(sum);
      float* o = chunk_out + (h * chunks + c) * head_dim;
      std::fill(o, o + head_dim, 0.0f);
    }
    for (int64_t j = j0; j < j1; ++j) {
      const float* vr = v.Row(g, idx != nullptr ? idx[j] : j);
      if (idx != nullptr && j + kAhead < j1) Prefetch(v.Row(g, idx[j + kAhead]), head_dim);
      for (int h = h0; h < h0 + group; ++h) {
        const float p = scores[h * num_rows + j];
        float* o = chunk_out + (h * chunks + c) * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) o[d] += p * vr[d];
      }
    }
  }
  // Merge the chunks of each query head.
  for (int h = 0; h < num_heads; ++h) {
    const float* m = chunk_max + h * chunks;
    float max_v = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) max_v = std::max(max_v, m[c]);
    float* oh = out + h * head_dim;
    float* s = scores + h * num_rows;
    if (max_v == -INFINITY) {  // every score -inf: uniform is the only finite answer
      std::fill(oh, oh + head_dim, 0.0f);
      const int32_t* idx = indices != nullptr ? indices + (h / group) * num_rows : nullptr;
      for (int64_t j = 0; j < num_rows; ++j) {
        const float* vr = v.Row(h / group, idx != nullptr ? idx[j] : j);
        for (int d = 0; d < head_dim; ++d) oh[d] += vr[d] / num_rows;
      }
      if (weights_out != nullptr)
        std::fill_n(weights_out + h * num_rows, num_rows, 1.0f / num_rows);
      continue;
    }
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      total += static_cast<double>(chunk_sum[h * chunks + c]) * std::exp(m[c] - max_v);
    }
    std::fill(oh, oh + head_dim, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = static_cast<float>(std::exp(m[c] - max_v) / total);
      const float* o = chunk_out + (h * chunks + c) * head_dim;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) oh[d] += w * o[d];
      if (weights_out != nullptr) {
        const int64_t j0 = c * kDecodeChunk, j1 = std::min(num_rows, j0 + kDecodeChunk);
        for (int64_t j = j0; j < j1; ++j) weights_out[h * num_rows + j] = s[j] * w;
      }
    }
  }
}

}  // namespace infinigen::cpu
