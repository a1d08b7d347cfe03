#include "kernels/cpu/selection.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

namespace infinigen::cpu {
namespace {

// Rows times heads below which the group mass stays on the calling thread.
constexpr int64_t kParallelWork = 1 << 16;

// e^x for x in [-87, 0], within 2 ulp of std::exp, branch-free so that loops over it
// vectorize: x = m ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (error
// below 1.2e-7 relative there), 2^m through the exponent bits. Clamp x in a loop of its own:
// a clamp in here lets the compiler branch to a constant and the loop no longer vectorizes.
inline float ExpNonPositive(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float m = (x * 1.44269504f + kRound) - kRound;
  const float r = (x - m * 0.693145752f) - m * 1.42860677e-6f;  // ln2 split in two parts
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(m) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace

// e^(s[j] - mx) for j < rows <= kScoreBlock into e (clamped at e^-87: 1.6e-38).
inline void ExpsOfBlock(const float* __restrict s, int64_t rows, float mx, float* __restrict e) {
#pragma omp simd
  for (int64_t j = 0; j < rows; ++j) e[j] = std::max(s[j] - mx, -87.0f);
#pragma omp simd
  for (int64_t j = 0; j < rows; ++j) e[j] = ExpNonPositive(e[j]);
}

void BlockSoftmax(const float* s, int64_t rows, float* max, float* sum) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < rows; ++j) mx = s[j] > mx ? s[j] : mx;
  float e[kScoreBlock];
  ExpsOfBlock(s, rows, mx, e);
  float total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < rows; ++j) total += e[j];
  *max = mx;
  *sum = total;
}

void CombineBlockSoftmax(int num_heads, int64_t blocks, const float* block_max,
                         const float* block_sum, float* max, float* inv_sum) {
  for (int h = 0; h < num_heads; ++h) {
    const float* m = block_max + h * blocks;
    const float* s = block_sum + h * blocks;
    const float mx = *std::max_element(m, m + blocks);
    float sum = 0;  // the blocks in order: within ~1e-6 of a double sum
    for (int64_t b = 0; b < blocks; ++b) sum += s[b] * ExpNonPositive(std::max(m[b] - mx, -87.0f));
    max[h] = mx;
    inv_sum[h] = 1.0f / sum;
  }
}

void GroupMassPhase(bool parallel, const float* scores, const float* max, const float* inv_sum,
                    int num_heads, int num_kv_heads, int64_t n, float* mass, float alpha,
                    int64_t* block_counts) {
  const int group = num_heads / num_kv_heads;
  const int64_t blocks = (n + kScoreBlock - 1) / kScoreBlock;
  ParallelFor(blocks * num_kv_heads, parallel, [&](int64_t t) {
    const int g = static_cast<int>(t % num_kv_heads);
    const int64_t b = t / num_kv_heads;
    const int64_t j0 = b * kScoreBlock;
    const int64_t rows = std::min(n, j0 + kScoreBlock) - j0;
    float* __restrict o = mass + static_cast<size_t>(g) * n + j0;
    float e[kScoreBlock];
#pragma omp simd
    for (int64_t j = 0; j < rows; ++j) o[j] = 0.0f;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float* s = scores + static_cast<size_t>(h) * n + j0;
      ExpsOfBlock(s, rows, max[h], e);
      const float inv = inv_sum[h];
#pragma omp simd
      for (int64_t j = 0; j < rows; ++j) o[j] += e[j] * inv;
      if (block_counts != nullptr) {
        const float threshold = max[h] - alpha;
        int64_t count = 0;
#pragma omp simd reduction(+ : count)
        for (int64_t j = 0; j < rows; ++j) count += s[j] > threshold;
        block_counts[h * blocks + b] = count;
      }
    }
  });
}

void TopKPhase(bool parallel, const float* mass, int num_kv_heads, int64_t n, int64_t k,
               const std::vector<int32_t>* forced, int32_t* out, int64_t out_stride) {
  ParallelFor(num_kv_heads, parallel, [&](int64_t g) {
    TopK(mass + static_cast<size_t>(g) * n, n, k, forced[g], out + g * out_stride);
  });
}

void GroupAttentionMass(const float* scores, int num_heads, int num_kv_heads, int64_t n,
                        std::vector<float>& out) {
  out.resize(static_cast<size_t>(num_kv_heads) * n);
  const int64_t blocks = (n + kScoreBlock - 1) / kScoreBlock;
  // Scratch of the calling thread, shared with the team through plain pointers.
  thread_local std::vector<float> max, inv_sum, block_max, block_sum;
  max.resize(static_cast<size_t>(num_heads));
  inv_sum.resize(static_cast<size_t>(num_heads));
  block_max.resize(static_cast<size_t>(num_heads * blocks));
  block_sum.resize(block_max.size());
  float *const mx = max.data(), *const inv = inv_sum.data();
  float *const bmax = block_max.data(), *const bsum = block_sum.data();
  float* const mass = out.data();
  const bool parallel = num_heads * n >= kParallelWork;
  // The softmax from blocks of rows, as a choice makes it (Choose).
  ParallelFor(num_heads * blocks, parallel, [&](int64_t t) {
    const int64_t h = t / blocks, b = t % blocks, b0 = b * kScoreBlock;
    BlockSoftmax(scores + h * n + b0, std::min(n, b0 + kScoreBlock) - b0, bmax + t, bsum + t);
  });
  CombineBlockSoftmax(num_heads, blocks, bmax, bsum, mx, inv);
  GroupMassPhase(parallel, scores, mx, inv, num_heads, num_kv_heads, n, mass);
}

namespace {

constexpr int64_t kLanes = kScoreLanes;
static_assert(kScoreBlock % kLanes == 0);

// Rows [0, rows) of one group of lanes, rows <= kLanes.
inline void ScoreTail(const float* q, const uint16_t* keys, int64_t channel_stride, int64_t rows,
                      int partial_dim, float scale, float* out) {
  float acc[kLanes] = {};
  for (int c = 0; c < partial_dim; ++c) {
    const float qc = q[c];
    const uint16_t* kc = keys + c * channel_stride;
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) {
      acc[i] += qc * std::bit_cast<float>(static_cast<uint32_t>(kc[i]) << 16);
    }
  }
  for (int64_t i = 0; i < rows; ++i) out[i] = acc[i] * scale;
}

// Vectors of the compiler (GCC and Clang): the sums of 16 rows of up to 4 heads stay in eight
// registers across the channels, and each key is loaded once for all of them (an accumulator
// array went through memory for each channel, and each head loaded the keys again).
typedef float F8 __attribute__((vector_size(32)));
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

inline F8 Splat(float x) { return F8{x, x, x, x, x, x, x, x}; }

inline F8 Bf16x8(const uint16_t* p) {
  U16x8 h;
  std::memcpy(&h, p, sizeof(h));
  const U32x8 w = __builtin_convertvector(h, U32x8) << 16;
  F8 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// 16 rows of kHeads heads (queries q + i * partial_dim, outputs out + i * out_stride).
template <int kHeads>
inline void ScoreLanes(const float* q, const uint16_t* keys, int64_t channel_stride,
                       int partial_dim, float scale, float* out, int64_t out_stride) {
  F8 a[kHeads][2] = {};
  for (int c = 0; c < partial_dim; ++c) {
    const uint16_t* kc = keys + c * channel_stride;
    const F8 k0 = Bf16x8(kc), k1 = Bf16x8(kc + 8);
    for (int i = 0; i < kHeads; ++i) {
      const F8 qc = Splat(q[i * partial_dim + c]);
      a[i][0] += qc * k0;
      a[i][1] += qc * k1;
    }
  }
  const F8 sc = Splat(scale);
  for (int i = 0; i < kHeads; ++i) {
    const F8 lo = a[i][0] * sc, hi = a[i][1] * sc;
    std::memcpy(out + i * out_stride, &lo, sizeof(lo));
    std::memcpy(out + i * out_stride + 8, &hi, sizeof(hi));
  }
}

}  // namespace

void ScorePartialBlockHeads(const float* q, int heads, const PartialKeyLayout& keys, int64_t lane0,
                            int64_t rows, int partial_dim, float scale, float* out,
                            int64_t out_stride) {
  // Each row's sum is summed in channel order (a multiply, then an add), so it is the same
  // float whichever block, group of lanes or set of heads it is scored with.
  for (int h0 = 0; h0 < heads; h0 += 4) {
    const int m = std::min(4, heads - h0);
    const float* qh = q + static_cast<size_t>(h0) * partial_dim;
    float* oh = out + h0 * out_stride;
    const uint16_t* group = keys.rows;
    int64_t i = 0;    // rows done
    if (lane0 > 0) {  // the rest of a group begun before
      const int64_t head_rows = std::min(rows, kLanes - lane0);
      for (int h = 0; h < m; ++h) {
        ScoreTail(qh + h * partial_dim, group, keys.channel_stride, head_rows, partial_dim, scale,
                  oh + h * out_stride);
      }
      i = head_rows;
      group += keys.group_stride - lane0;
    }
    const int64_t group_bytes = keys.group_stride * static_cast<int64_t>(sizeof(uint16_t));
    for (; i + kLanes <= rows; i += kLanes, group += keys.group_stride) {
      // Tiled keys are one run of memory per block of rows, read once per choice from DRAM (a
      // decode step's other reads evict them): ask for the group 4 ahead, so that several groups'
      // misses are in flight while one is scored. The hardware's prefetch alone left the loads
      // waiting: this took a decode step's choices on SmolLM2 at 8K rows from 5.3 to 4.0 ms (2
      // ahead the same, 8 slower; docs/benchmarks.md).
      if (keys.channel_stride == kLanes) {  // (an address past the keys' end is a hint too)
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(group) + 4 * group_bytes;
        for (int64_t off = 0; off < group_bytes + 63; off += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + off));
        }
      }
      switch (m) {
        case 4:
          ScoreLanes<4>(qh, group, keys.channel_stride, partial_dim, scale, oh + i, out_stride);
          break;
        case 3:
          ScoreLanes<3>(qh, group, keys.channel_stride, partial_dim, scale, oh + i, out_stride);
          break;
        case 2:
          ScoreLanes<2>(qh, group, keys.channel_stride, partial_dim, scale, oh + i, out_stride);
          break;
        default:
          ScoreLanes<1>(qh, group, keys.channel_stride, partial_dim, scale, oh + i, out_stride);
      }
    }
    for (int h = 0; h < m && i < rows; ++h) {
      ScoreTail(qh + h * partial_dim, group, keys.channel_stride, rows - i, partial_dim, scale,
                oh + h * out_stride + i);
    }
  }
}

void ProjectPartial(const float* x, const float* a, int d, int p, float* out) {
  std::fill(out, out + p, 0.0f);
  for (int i = 0; i < d; ++i) {
    const float xi = x[i];
    const float* row = a + static_cast<size_t>(i) * p;
    for (int c = 0; c < p; ++c) out[c] += xi * row[c];
  }
}

int64_t AlphaCount(const float* s, int64_t n, float alpha) {
  float best = -INFINITY;
#pragma omp simd reduction(max : best)
  for (int64_t j = 0; j < n; ++j) best = s[j] > best ? s[j] : best;
  const float threshold = best - alpha;
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t j = 0; j < n; ++j) count += s[j] > threshold;
  return count;
}

int64_t BudgetFromCounts(std::span<const int64_t> head_counts, int64_t k_min, int64_t k_max) {
  double sum = 0;
  for (int64_t c : head_counts) sum += static_cast<double>(c);
  const double mean = head_counts.empty() ? 0.0 : sum / static_cast<double>(head_counts.size());
  return std::clamp<int64_t>(std::llround(mean), std::min(k_min, k_max), k_max);
}

namespace {

// Calls f(vector, its size for a choice over n rows) on every buffer of `s`.
template <typename F>
void ForEachBuffer(ChoiceScratch& s, int num_heads, int num_kv_heads, int64_t n, const F& f) {
  const size_t rows = static_cast<size_t>(n), heads = static_cast<size_t>(num_heads);
  const size_t blocks = static_cast<size_t>((n + kScoreBlock - 1) / kScoreBlock);
  f(s.scores, heads * rows);
  f(s.mass, static_cast<size_t>(num_kv_heads) * rows);
  f(s.max, heads);
  f(s.inv_sum, heads);
  f(s.block_max, heads * blocks);
  f(s.block_sum, heads * blocks);
  f(s.block_counts, heads * blocks);
}

}  // namespace

void ChoiceScratch::Reserve(int num_heads, int num_kv_heads, int64_t n) {
  ForEachBuffer(*this, num_heads, num_kv_heads, n, [](auto& v, size_t size) { v.reserve(size); });
}

size_t ChoiceScratch::Bytes(int num_heads, int num_kv_heads, int64_t n) {
  ChoiceScratch none;
  size_t bytes = 0;
  ForEachBuffer(none, num_heads, num_kv_heads, n, [&bytes](auto& v, size_t size) {
    bytes += size * sizeof(typename std::decay_t<decltype(v)>::value_type);
  });
  return bytes;
}

void ChoiceScratch::Size(int num_heads, int num_kv_heads, int64_t n) {
  ForEachBuffer(*this, num_heads, num_kv_heads, n, [](auto& v, size_t size) { v.resize(size); });
}

int64_t ChooseRows(const RowChoice& c, const float* q_partial, const uint16_t* keys,
                   int32_t* indices, int64_t index_capacity) {
  const int64_t n = c.rows;
  if (n <= 0) return 0;
  thread_local ChoiceScratch scratch;
  thread_local std::vector<std::vector<int32_t>> forced;
  scratch.Size(c.num_heads, c.num_kv_heads, n);
  forced.resize(static_cast<size_t>(c.num_kv_heads));
  for (auto& f : forced) f.assign(c.force_last ? 1 : 0, static_cast<int32_t>(n - 1));
  const auto keys_at = [&](int64_t j0, int g) {  // channel-major: groups of lanes kLanes apart
    return PartialKeyLayout{keys + static_cast<size_t>(g) * c.partial_dim * c.capacity + j0,
                            c.capacity, kLanes};
  };
  int64_t k = 0;
  Choose(c, q_partial, 0, keys_at, forced.data(), scratch, [&](int64_t counted) {
    k = c.margin ? std::min(n, counted + PrefetchMargin(counted)) : counted;
    k = std::min({k, n, index_capacity});
    return ChoiceTarget{k, indices, index_capacity};
  });
  return k;
}

std::span<const int64_t> HeadCounts(int num_heads, int64_t blocks, int64_t* block_counts) {
  for (int h = 0; h < num_heads; ++h) {
    int64_t total = 0;
    for (int64_t b = 0; b < blocks; ++b) total += block_counts[h * blocks + b];
    block_counts[h] = total;  // h <= h * blocks: read before written
  }
  return {block_counts, static_cast<size_t>(num_heads)};
}

}  // namespace infinigen::cpu
