// CPU reference operations, float32. These are the oracles every device kernel is tested
// against, and the compute of CpuBackend. All matrices are row-major with an explicit row
// stride in elements; outputs never alias inputs unless a function says so. The caller owns
// all memory.
#pragma once

#include <cstdint>
#include <span>

namespace infinigen::cpu {

// How RoPE pairs the channels of a head: kHalf rotates (i, i + rotary_dim/2) as Hugging Face
// Llama does ("rotate_half"); kInterleaved rotates (2i, 2i + 1) as Meta's original code and
// GGUF llama files do.
enum class RopeLayout { kHalf, kInterleaved };

// K or V rows of one layer: row j of KV head g starts at data + g * head_stride + j * row_stride
// (in elements). With a row table instead (`rows` set, `data` unused), it starts at rows[g *
// head_stride + j * row_stride]: rows read in place wherever they live (AttentionDecode only).
// Elements are float32, or bfloat16 with `bf16` (widened exactly to float32 as they are read).
struct KvRows {
  const void* data = nullptr;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
  const void* const* rows = nullptr;
  bool bf16 = false;

  const void* Row(int64_t g, int64_t j) const {
    const int64_t at = g * head_stride + j * row_stride;
    if (rows != nullptr) return rows[at];
    return static_cast<const uint8_t*>(data) + at * (bf16 ? 2 : 4);
  }
};

// out[i, :] = table[ids[i], :]. Ids are checked by the caller (0 <= id < vocab).
void Embedding(const float* table, int64_t dim, const int32_t* ids, int64_t n, float* out,
               int64_t out_stride);

// out = x / sqrt(mean(x^2) + eps) * weight, per row. out may alias x.
void RmsNorm(const float* x, int64_t x_stride, const float* weight, int64_t rows, int64_t cols,
             float eps, float* out, int64_t out_stride);

// out = (x - mean) / sqrt(var + eps) * weight + bias, per row (biased variance). out may
// alias x. weight or bias may be null (1 and 0).
void LayerNorm(const float* x, int64_t x_stride, const float* weight, const float* bias,
               int64_t rows, int64_t cols, float eps, float* out, int64_t out_stride);

// y[m, n] = x[m, k] · w[n, k]ᵀ + bias[n] (+ y[m, n] when accumulate). bias may be null.
void Gemm(const float* x, int64_t ldx, const float* w, int64_t ldw, const float* bias, float* y,
          int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);

// Rotates the first rotary_dim channels of every head of every row in place. Row r holds
// num_heads heads of head_dim channels and sits at position positions[r]; channel pair i of
// head h turns by positions[r] * inv_freq[h * inv_freq_head_stride + i] (rotary_dim / 2 entries
// per head; stride 0: every head turns by the same ones).
void Rope(float* x, int64_t stride, int64_t rows, int num_heads, int head_dim, int rotary_dim,
          const int32_t* positions, const float* inv_freq, RopeLayout layout,
          int64_t inv_freq_head_stride = 0);

// Each head on its KV head's partial skew: out[r, h * p + c] = sum_i x[r, h * d + i] *
// skew[g, i, c] for g = h / (num_heads / num_kv_heads), i ascending. x: [rows, num_heads * d],
// skew: [num_kv_heads, d, p], out: [rows, num_heads * p].
void ProjectHeads(const float* x, int64_t x_stride, int64_t rows, int num_heads, int num_kv_heads,
                  int head_dim, const float* skew, int partial_dim, float* out, int64_t out_stride);

// out[r, i] = silu(gate[r, i]) * up[r, i].
void SwiGlu(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride,
            int64_t rows, int64_t cols, float* out, int64_t out_stride);

// x = max(x, 0) in place, over rows × cols.
void Relu(float* x, int64_t stride, int64_t rows, int64_t cols);

// y[r, :] += x[r, :].
void Add(const float* x, int64_t x_stride, int64_t rows, int64_t cols, float* y, int64_t y_stride);

// out[i] = uniform in [-scale, scale) from a counter hash (splitmix64) of (seed, i): the CPU
// reference of kernels/cuda FillRandom, value for value.
void FillRandom(float* out, int64_t n, uint64_t seed, float scale, int64_t first = 0);

// Numerically stable softmax of x[0..n) in place.
void Softmax(float* x, int64_t n);

// Causal attention of num_q new query rows that sit at positions q_start .. q_start+num_q-1
// over keys/values at positions 0 .. q_start+num_q-1. q: [num_q, num_heads * head_dim];
// out: same shape. Query head h uses KV head h / (num_heads / num_kv_heads). Scores are
// q·k * scale. Float32 K/V only (OpenBLAS).
void AttentionCausal(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                     KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                     float* out, int64_t out_stride);

// The same, each query row computed exactly as AttentionDecode computes a decode token over the
// rows it sees: a row's result does not depend on the rows sharing the call, on q_start (a
// prompt in one piece or in chunks), or on whether it is a prompt's last token or a decode
// step. The batch-invariant backend's prefill.
void AttentionCausalRows(const float* q, int64_t q_stride, int64_t num_q, int64_t q_start, KvRows k,
                         KvRows v, int num_heads, int num_kv_heads, int head_dim, float scale,
                         float* out, int64_t out_stride);

// Attention of one query row (all heads) over an explicit list of rows per KV head: KV head g
// attends rows indices[g * num_rows + j] for j < num_rows (indices may be null: rows 0 ..
// num_rows-1). k and v may be row tables (KvRows::rows). GQA as in AttentionCausal. q, out:
// [num_heads * head_dim]. weights_out
// ([num_heads, num_rows], may be null) receives the attention probabilities.
void AttentionDecode(const float* q, KvRows k, KvRows v, const int32_t* indices, int64_t num_rows,
                     int num_heads, int num_kv_heads, int head_dim, float scale, float* out,
                     float* weights_out = nullptr);

// One decode query of AttentionDecodeBatch: AttentionDecode's arguments.
struct DecodeQuery {
  const float* q;
  KvRows k, v;
  const int32_t* indices;
  int64_t num_rows;
  float* out;
};
// AttentionDecode of every item, each item's output bit for bit what AttentionDecode of it alone
// gives (the same tasks and merges), their tasks shared out over the threads together: a batch
// of short contexts uses every core with two joins, not a join and a few tasks per item.
void AttentionDecodeBatch(std::span<const DecodeQuery> items, int num_heads, int num_kv_heads,
                          int head_dim, float scale);

}  // namespace infinigen::cpu
