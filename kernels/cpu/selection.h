// InfiniGen's row choice on the CPU (INFINIGEN.md, decode steps 2-5): speculated scores of
// partial keys, the alpha count, the group attention mass and the per-KV-head top-k. The
// host selection policy and CpuBackend::ChooseRows share these, so that a choice made through
// the backend is the host policy's, float for float; they are also the oracle of the CUDA
// kernels (kernels/cuda/selection.cu).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/parallel_for.h"

namespace infinigen::cpu {

// Rows scored together per query head (accumulators on the stack).
constexpr int64_t kScoreBlock = 256;

// Rows scored together in registers: a group of lanes.
constexpr int64_t kScoreLanes = 16;

// Where bfloat16 partial keys lie: row i (counted from `rows`, whose position within its group
// of kScoreLanes rows is the caller's lane0), channel c at
//   rows + ((lane0 + i) / kScoreLanes) * group_stride + ((lane0 + i) % kScoreLanes) - lane0
//        + c * channel_stride.
// Channel-major keys [p][capacity]: channel_stride = capacity, group_stride = kScoreLanes.
// Tiled keys [groups][p][kScoreLanes] (a group's channels in one run of memory, streamed from
// DRAM in order): channel_stride = kScoreLanes, group_stride = p * kScoreLanes.
struct PartialKeyLayout {
  const uint16_t* rows = nullptr;
  int64_t channel_stride = 0;
  int64_t group_stride = 0;
};

// out[h * out_stride + i] = scale * sum over c of q[h, c] * key_c[i] for i < rows and the
// `heads` query heads sharing the keys (a GQA group; q [heads, partial_dim]), each key read
// once for all of them. Each row's sum is summed in channel order whatever the block.
void ScorePartialBlockHeads(const float* q, int heads, const PartialKeyLayout& keys, int64_t lane0,
                            int64_t rows, int partial_dim, float scale, float* out,
                            int64_t out_stride);

// out[c] = sum over i of x[i] * a[i, c] for a: [d, p] (float32, summed in i order): a key or
// query head through the skew's partial channels.
void ProjectPartial(const float* x, const float* a, int d, int p, float* out);

// #{j < n : s[j] > max(s) - alpha}: the rows within alpha logits of the head's best.
int64_t AlphaCount(const float* s, int64_t n, float alpha);

// The budget from the heads' alpha counts: their mean, rounded half away from zero, clamped to
// [min(k_min, k_max), k_max].
int64_t BudgetFromCounts(std::span<const int64_t> head_counts, int64_t k_min, int64_t k_max);

// Per head the sum of its blocks' alpha counts (GroupMassPhase's block_counts [num_heads,
// blocks]), written over the first num_heads entries, which it returns.
std::span<const int64_t> HeadCounts(int num_heads, int64_t blocks, int64_t* block_counts);

// Rows prefetched beyond a counted budget k: one for the count the current token may add, and
// a share for rows whose rank changes once it joins each head's softmax (docs/accuracy.md,
// "Rows moved").
inline int64_t PrefetchMargin(int64_t k) { return 1 + (k / 16 > 2 ? k / 16 : 2); }

// Chooses min(k, n) slots of one KV head: every slot in `forced` first, then the highest
// `scores[slot]` among the other slots in [0, n), ties to the lower slot (NaN ranks lowest).
// Writes them in ascending slot order to `out` and returns how many. A radix select and a pass
// in slot order: no sort. Safe to call from several threads at once. (kernels/cpu/top_k.cc)
int64_t TopK(const float* scores, int64_t n, int64_t k, std::span<const int32_t> forced,
             int32_t* out);

// For GQA: per KV head, the sum over its query heads of softmax(scores[h]) (the predicted
// attention mass). scores: [num_heads, n]; out: [num_kv_heads, n]. On the team (team.h) for
// large n; the exponentials are within 2 ulp of std::exp.
void GroupAttentionMass(const float* scores, int num_heads, int num_kv_heads, int64_t n,
                        std::vector<float>& out);

// The rows' max and sum of e^(s - max) (rows <= kScoreBlock).
void BlockSoftmax(const float* s, int64_t rows, float* max, float* sum);

// The phases of one choice, each a loop split over the process's team when `parallel` holds
// (kernels/cpu/team.h: a hand-off and a join, not a fork) and otherwise run on the calling
// thread. Either way the results are the same floats, and the same as AlphaCount and
// GroupAttentionMass compute. Choose runs them.
//
// Scores of rows [first, n) of every query head into scores [num_heads, n], in blocks of
// kScoreBlock rows aligned to multiples of kScoreBlock: keys_at(j0, g) is the PartialKeyLayout
// of KV head g from row j0 (a block never crosses a boundary the caller's layout has at
// multiples of kScoreBlock). Then, for every block b of rows [0, n) (the rows before `first`
// hold scores already) and head h, while they are in cache: block_max[h * blocks + b] and
// block_sum[h * blocks + b] = sum over the block's rows of e^(s - block max) (BlockSoftmax;
// CombineBlockSoftmax makes the heads' softmax from them). blocks = ceil(n / kScoreBlock).
template <typename KeysAt>
void ScorePhase(bool parallel, const float* q_partial, int num_heads, int num_kv_heads,
                int partial_dim, float scale, int64_t first, int64_t n, const KeysAt& keys_at,
                float* scores, float* block_max, float* block_sum) {
  const int group = num_heads / num_kv_heads;
  const int64_t blocks = (n + kScoreBlock - 1) / kScoreBlock;
  // KV head by KV head, blocks in row order: a thread's share is a stream through one head's
  // keys (ScorePartialBlockHeads prefetches into its next block).
  ParallelFor(blocks * num_kv_heads, parallel, [&](int64_t t) {
    const int g = static_cast<int>(t / blocks);
    const int64_t b = t % blocks;
    const int64_t b0 = b * kScoreBlock, b1 = n < b0 + kScoreBlock ? n : b0 + kScoreBlock;
    const int64_t j0 = first > b0 ? first : b0;
    if (j0 < b1) {
      ScorePartialBlockHeads(q_partial + static_cast<size_t>(g) * group * partial_dim, group,
                             keys_at(j0, g), j0 % kScoreLanes, b1 - j0, partial_dim, scale,
                             scores + static_cast<size_t>(g) * group * n + j0, n);
    }
    for (int h = g * group; h < (g + 1) * group; ++h) {
      BlockSoftmax(scores + static_cast<size_t>(h) * n + b0, b1 - b0, block_max + h * blocks + b,
                   block_sum + h * blocks + b);
    }
  });
}
// Per head h (on the calling thread): max[h] over its
// blocks, and inv_sum[h] = 1 / sum over blocks of block_sum * e^(block_max - max[h]).
void CombineBlockSoftmax(int num_heads, int64_t blocks, const float* block_max,
                         const float* block_sum, float* max, float* inv_sum);
// mass [num_kv_heads, n]: per KV head the sum, over its query heads in order, of
// e^(s[h, j] - max[h]) * inv_sum[h]; rows in parallel. (The exponentials are computed again
// here rather than kept: storing heads x n of them cost more than computing them twice.) With
// block_counts ([num_heads, blocks] as ScorePhase's), also each block's rows within alpha of
// max[h] (AlphaCount's, summed by the caller over the blocks).
void GroupMassPhase(bool parallel, const float* scores, const float* max, const float* inv_sum,
                    int num_heads, int num_kv_heads, int64_t n, float* mass, float alpha = 0.0f,
                    int64_t* block_counts = nullptr);
// TopK of every KV head's row of mass [num_kv_heads, n] (forced[g] first) to
// out + g * out_stride, KV heads in parallel.
void TopKPhase(bool parallel, const float* mass, int num_kv_heads, int64_t n, int64_t k,
               const std::vector<int32_t>* forced, int32_t* out, int64_t out_stride);

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

// Work (heads x rows) from which a choice runs on every thread: a 1K-token sequence of a 9-head
// model does.
constexpr int64_t kParallelChoice = 1 << 13;

// What one choice over n rows needs besides its inputs; the caller's, so that it keeps its
// capacity from step to step (Reserve once, Size per choice).
struct ChoiceScratch {
  std::vector<float> scores, mass, max, inv_sum, block_max, block_sum;
  std::vector<int64_t> block_counts;
  void Reserve(int num_heads, int num_kv_heads, int64_t n);
  void Size(int num_heads, int num_kv_heads, int64_t n);
  // What Reserve(num_heads, num_kv_heads, n) holds, in bytes.
  static size_t Bytes(int num_heads, int num_kv_heads, int64_t n);
};
// Where and how many rows a choice writes: per KV head g, k rows at indices + g * stride; none
// (every row, or no choice) when indices is null.
struct ChoiceTarget {
  int64_t k = 0;
  int32_t* indices = nullptr;
  int64_t stride = 0;
};

// One choice over c.rows = n rows (c.capacity, c.margin and c.force_last are the caller's to
// apply), its phases on the team one after another: scores of rows [first, n) into s.scores (the
// rows before `first` hold scores already: Size first, then copy them), the heads' softmax from the
// blocks, the group mass with the alpha counts, then on_budget(k) on one thread with k =
// BudgetFromCounts(...) (it returns the ChoiceTarget), then the top k rows of each KV head by
// mass (forced[g] first).
template <typename KeysAt, typename OnBudget>
void Choose(const RowChoice& c, const float* q_partial, int64_t first, const KeysAt& keys_at,
            const std::vector<int32_t>* forced, ChoiceScratch& s, const OnBudget& on_budget) {
  const int heads = c.num_heads, kv_heads = c.num_kv_heads;
  const int64_t n = c.rows;
  const int64_t blocks = (n + kScoreBlock - 1) / kScoreBlock;
  // The team's threads reach the scratch through plain pointers.
  float *const scores = s.scores.data(), *const mass = s.mass.data();
  float *const max = s.max.data(), *const inv_sum = s.inv_sum.data();
  float *const block_max = s.block_max.data(), *const block_sum = s.block_sum.data();
  int64_t* const block_counts = s.block_counts.data();
  const bool parallel = heads * n >= kParallelChoice;
  ScorePhase(parallel, q_partial, heads, kv_heads, c.partial_dim, c.scale, first, n, keys_at,
             scores, block_max, block_sum);
  CombineBlockSoftmax(heads, blocks, block_max, block_sum, max, inv_sum);
  // The group mass of every row (a choice of all rows is rare at any length that matters),
  // counting each head's rows within alpha on the way.
  GroupMassPhase(parallel, scores, max, inv_sum, heads, kv_heads, n, mass, c.alpha, block_counts);
  const ChoiceTarget target =
      on_budget(BudgetFromCounts(HeadCounts(heads, blocks, block_counts), c.k_min, c.k_max));
  if (target.indices != nullptr) {
    TopKPhase(parallel, mass, kv_heads, n, target.k, forced, target.indices, target.stride);
  }
}

}  // namespace infinigen::cpu
