// InfiniGen's row choice on the CPU (INFINIGEN.md, decode steps 2-5): speculated scores of
// partial keys, the alpha count, the group attention mass and the per-KV-head top-k. The
// host selection policy and CpuBackend::ChooseRows share these, so that a choice made through
// the backend is the host policy's, float for float; they are also the oracle of the CUDA
// kernels (kernels/cuda/selection.cu).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace infinigen::cpu {

// Rows scored together per query head (accumulators on the stack).
constexpr int64_t kScoreBlock = 256;

// out[i] = scale * sum over c of q[c] * key_c[i] for i < rows (<= kScoreBlock), summed in
// channel order whatever the block: keys are bfloat16, channel-major (channel c of the block's
// rows at keys + c * channel_stride).
void ScorePartialBlock(const float* q, const uint16_t* keys, int64_t channel_stride, int64_t rows,
                       int partial_dim, float scale, float* out);

// out[c] = sum over i of x[i] * a[i, c] for a: [d, p] (float32, summed in i order): a key or
// query head through the skew's partial channels.
void ProjectPartial(const float* x, const float* a, int d, int p, float* out);

// #{j < n : s[j] > max(s) - alpha}: the rows within alpha logits of the head's best.
int64_t AlphaCount(const float* s, int64_t n, float alpha);

// The budget from the heads' alpha counts: their mean, rounded half away from zero, clamped to
// [min(k_min, k_max), k_max].
int64_t BudgetFromCounts(std::span<const int64_t> head_counts, int64_t k_min, int64_t k_max);

// Rows prefetched beyond a counted budget k: one for the count the current token may add, and
// a share for rows whose rank changes once it joins each head's softmax (docs/accuracy.md,
// "Rows moved").
inline int64_t PrefetchMargin(int64_t k) { return 1 + (k / 16 > 2 ? k / 16 : 2); }

// Chooses min(k, n) slots of one KV head: every slot in `forced` first, then the highest
// `scores[slot]` among the other slots in [0, n), ties to the lower slot (NaN ranks lowest).
// Writes them in ascending slot order to `out` and returns how many. A radix select and a pass
// in slot order: no sort. Safe to call from several threads at once.
int64_t TopK(const float* scores, int64_t n, int64_t k, std::span<const int32_t> forced,
             int32_t* out);

// For GQA: per KV head, the sum over its query heads of softmax(scores[h]) (the predicted
// attention mass). scores: [num_heads, n]; out: [num_kv_heads, n]. Several threads (OpenMP)
// for large n; the exponentials are within 2 ulp of std::exp.
void GroupAttentionMass(const float* scores, int num_heads, int num_kv_heads, int64_t n,
                        std::vector<float>& out);

// One sequence's choice over n rows of partial keys stored channel-major per KV head (channel
// c of head g, row j at keys[(g * partial_dim + c) * capacity + j]): the speculated scores of
// q_partial [num_heads, partial_dim], k = BudgetFromCounts (plus PrefetchMargin with `margin`,
// at most n), and per KV head the top k rows by group attention mass (row n - 1 always, with
// `force_last`), ascending, at indices[g * index_capacity]. Returns k.
struct RowChoice {
  int num_heads = 0, num_kv_heads = 0, partial_dim = 0;
  float scale = 1.0f, alpha = 10.0f;
  int64_t rows = 0, capacity = 0;  // n, and the rows the keys have room for
  int64_t k_min = 1, k_max = 1;
  bool margin = false, force_last = false;
};
int64_t ChooseRows(const RowChoice& c, const float* q_partial, const uint16_t* keys,
                   int32_t* indices, int64_t index_capacity);

}  // namespace infinigen::cpu
