#include "kernels/cpu/selection.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <utility>

namespace infinigen::cpu {
namespace {

// Rows times heads below which the selection helpers stay on the calling thread, and (smaller)
// below which the scoring does.
constexpr int64_t kParallelWork = 1 << 16;
constexpr int64_t kParallelScores = 1 << 13;

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

// An unsigned key in the order of the floats (NaN lowest; -0 equal to +0, as the floats are).
inline uint32_t OrderKey(float v) {
  const uint32_t b = std::bit_cast<uint32_t>(v + 0.0f);  // -0 + 0 = +0
  const uint32_t key = (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
  return v == v ? key : 0u;
}

// The rank-th largest of `keys` (1-based, rank <= keys.size()), by radix select on 11, 11 and
// 10 bits, keeping only the keys of the chosen digit after each pass (destroys `keys`). Also
// how many keys equal to it are within the top `rank`.
uint32_t RadixSelect(std::vector<uint32_t>& keys, int64_t rank, int64_t* ties) {
  uint32_t prefix = 0;
  int64_t size = static_cast<int64_t>(keys.size());
  for (const auto [shift, bits] : {std::pair{21, 11}, std::pair{10, 11}, std::pair{0, 10}}) {
    const uint32_t mask = (1u << bits) - 1;
    int64_t hist[2048] = {};
    for (int64_t i = 0; i < size; ++i) ++hist[(keys[i] >> shift) & mask];
    uint32_t digit = mask;
    while (rank > hist[digit]) rank -= hist[digit--];
    prefix |= digit << shift;
    int64_t kept = 0;
    for (int64_t i = 0; i < size; ++i) {
      if (((keys[i] >> shift) & mask) == digit) keys[kept++] = keys[i];
    }
    size = kept;
  }
  *ties = rank;
  return prefix;
}

}  // namespace

int64_t TopK(const float* scores, int64_t n, int64_t k, std::span<const int32_t> forced,
             int32_t* out) {
  // The forced slots (in range, once each, at most k), ascending.
  thread_local std::vector<int32_t> chosen;
  chosen.clear();
  for (int32_t f : forced) {
    if (f >= 0 && f < n && static_cast<int64_t>(chosen.size()) < k &&
        std::find(chosen.begin(), chosen.end(), f) == chosen.end()) {
      chosen.push_back(f);
    }
  }
  std::sort(chosen.begin(), chosen.end());
  const int64_t num_forced = static_cast<int64_t>(chosen.size());
  const int64_t need = std::min(k, n) - num_forced;
  // The need-th largest key among the other slots (forced slots enter the select as the lowest
  // key, which changes nothing: need <= n - num_forced), then one pass in slot order taking
  // every other slot above it and the lowest slots equal to it: the same set as ranking by
  // (score descending, slot ascending), already in slot order, without sorting.
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<int32_t> taken;
  taken.clear();
  if (need > 0) {
    keys.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) keys[j] = OrderKey(scores[j]);
    for (int32_t f : chosen) keys[f] = 0;
    int64_t ties = 0;
    const uint32_t kth = RadixSelect(keys, need, &ties);
    size_t next_forced = 0;
    for (int64_t j = 0; j < n && static_cast<int64_t>(taken.size()) < need; ++j) {
      if (next_forced < chosen.size() && chosen[next_forced] == j) {
        ++next_forced;
        continue;
      }
      const uint32_t key = OrderKey(scores[j]);
      if (key > kth || (key == kth && ties > 0)) {
        if (key == kth) --ties;
        taken.push_back(static_cast<int32_t>(j));
      }
    }
  }
  std::merge(chosen.begin(), chosen.end(), taken.begin(), taken.end(), out);
  return num_forced + static_cast<int64_t>(taken.size());
}

void GroupAttentionMass(const float* scores, int num_heads, int num_kv_heads, int64_t n,
                        std::vector<float>& out) {
  out.assign(static_cast<size_t>(num_kv_heads) * n, 0.0f);
  const int group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(static) if (num_heads * n >= kParallelWork)
  for (int g = 0; g < num_kv_heads; ++g) {
    thread_local std::vector<float> exps;
    exps.resize(static_cast<size_t>(n));
    float* __restrict e = exps.data();
    float* __restrict o = out.data() + static_cast<size_t>(g) * n;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float* __restrict s = scores + static_cast<size_t>(h) * n;
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) e[j] = std::max(s[j] - mx, -87.0f);  // e^-87: 1.6e-38
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) e[j] = ExpNonPositive(e[j]);
      float sum = 0;  // lanes summed apart, then together: within ~1e-6 of a double sum here
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) sum += e[j];
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] += e[j] * inv;
    }
  }
}

void ScorePartialBlock(const float* q, const uint16_t* keys, int64_t channel_stride, int64_t rows,
                       int partial_dim, float scale, float* out) {
  float acc[kScoreBlock] = {};
  for (int c = 0; c < partial_dim; ++c) {
    const float qc = q[c];
    const uint16_t* kc = keys + c * channel_stride;
#pragma omp simd
    for (int64_t i = 0; i < rows; ++i) {
      acc[i] += qc * std::bit_cast<float>(static_cast<uint32_t>(kc[i]) << 16);
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < rows; ++i) out[i] = acc[i] * scale;
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

int64_t ChooseRows(const RowChoice& c, const float* q_partial, const uint16_t* keys,
                   int32_t* indices, int64_t index_capacity) {
  const int heads = c.num_heads, kv_heads = c.num_kv_heads, group = heads / kv_heads;
  const int p = c.partial_dim;
  const int64_t n = c.rows;
  if (n <= 0) return 0;
  // Scratch of the calling thread; the parallel loops below reach it through plain pointers (a
  // thread_local named inside them would be each worker thread's own, empty, vector).
  thread_local std::vector<float> scores, mass;
  thread_local std::vector<int64_t> counts;
  scores.resize(static_cast<size_t>(heads) * n);
  float* const score_rows = scores.data();
  const int64_t blocks = (n + kScoreBlock - 1) / kScoreBlock;
#pragma omp parallel for schedule(static) if (heads * n >= kParallelScores)
  for (int64_t t = 0; t < blocks * kv_heads; ++t) {
    const int g = static_cast<int>(t % kv_heads);
    const int64_t j0 = (t / kv_heads) * kScoreBlock;
    const int64_t rows = std::min(n, j0 + kScoreBlock) - j0;
    const uint16_t* head_keys = keys + static_cast<size_t>(g) * p * c.capacity + j0;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      ScorePartialBlock(q_partial + static_cast<size_t>(h) * p, head_keys, c.capacity, rows, p,
                        c.scale, score_rows + static_cast<size_t>(h) * n + j0);
    }
  }
  counts.resize(static_cast<size_t>(heads));
  for (int h = 0; h < heads; ++h) {
    counts[h] = AlphaCount(scores.data() + static_cast<size_t>(h) * n, n, c.alpha);
  }
  int64_t k = BudgetFromCounts(counts, c.k_min, c.k_max);
  if (c.margin) k = std::min(n, k + PrefetchMargin(k));
  k = std::min({k, n, index_capacity});
  GroupAttentionMass(scores.data(), heads, kv_heads, n, mass);
  const float* const mass_rows = mass.data();
  const int32_t last = static_cast<int32_t>(n - 1);
  const std::span<const int32_t> forced(&last, c.force_last ? 1 : 0);
#pragma omp parallel for schedule(static) if (kv_heads * n >= kParallelWork)
  for (int g = 0; g < kv_heads; ++g) {
    TopK(mass_rows + static_cast<size_t>(g) * n, n, k, forced,
         indices + static_cast<size_t>(g) * index_capacity);
  }
  return k;
}

}  // namespace infinigen::cpu
