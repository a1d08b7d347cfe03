#include "gpu_worker/infinigen/selection_util.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <numeric>

#include "common/dtype.h"

namespace infinigen {

void SlotPositions::Reserve(SequenceId seq, int num_layers, int num_kv_heads, int64_t capacity) {
  auto& layers = seqs_[seq];
  if (static_cast<int>(layers.size()) < num_layers) layers.resize(num_layers);
  for (auto& heads : layers) {
    if (static_cast<int>(heads.size()) < num_kv_heads) heads.resize(num_kv_heads);
    for (auto& pos : heads) pos.reserve(static_cast<size_t>(capacity));
  }
}

void SlotPositions::Record(const LayerKeys& keys, int num_kv_heads) {
  auto& layers = seqs_[keys.seq];
  if (static_cast<int>(layers.size()) <= keys.layer) layers.resize(keys.layer + 1);
  auto& heads = layers[keys.layer];
  if (static_cast<int>(heads.size()) < num_kv_heads) heads.resize(num_kv_heads);
  for (int64_t t = 0; t < keys.count; ++t) {
    for (int g = 0; g < num_kv_heads; ++g) {
      const int32_t slot = keys.slots[t * num_kv_heads + g];
      auto& pos = heads[g];
      if (static_cast<int32_t>(pos.size()) <= slot) pos.resize(slot + 1, -1);
      pos[slot] = keys.start + t;
    }
  }
}

const std::vector<int64_t>& SlotPositions::Of(SequenceId seq, int layer, int head) const {
  static const std::vector<int64_t> kEmpty;
  auto it = seqs_.find(seq);
  if (it == seqs_.end() || layer >= static_cast<int>(it->second.size()) ||
      head >= static_cast<int>(it->second[layer].size())) {
    return kEmpty;
  }
  return it->second[layer][head];
}

namespace {

// Rows times heads below which the selection helpers stay on the calling thread.
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

void TopK(const float* scores, int64_t n, int64_t k, const std::vector<int32_t>& forced,
          std::vector<int32_t>& out) {
  const size_t begin = out.size();
  out.resize(begin + static_cast<size_t>(std::max<int64_t>(std::min(k, n), 0)));
  const int64_t written = TopK(scores, n, k, forced, out.data() + begin);
  out.resize(begin + static_cast<size_t>(written));
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

void ExactScores(const float* q, const KvLayerView& kv, int num_heads, int num_kv_heads,
                 int head_dim, float scale, std::vector<float>& out) {
  const int64_t n = kv.num_slots;
  out.resize(static_cast<size_t>(num_heads) * n);
  const int group = num_heads / num_kv_heads;
  const bool bf16 = kv.k.dtype == DType::kBF16;  // else float32
  std::vector<float> row(static_cast<size_t>(head_dim));
  for (int h = 0; h < num_heads; ++h) {
    const float* qh = q + static_cast<size_t>(h) * head_dim;
    const int64_t first = (h / group) * kv.k.head_stride;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = first + j * kv.k.row_stride;
      const float* kr = static_cast<const float*>(kv.k.data) + at;
      if (bf16) {
        const uint16_t* kb = static_cast<const uint16_t*>(kv.k.data) + at;
        for (int d = 0; d < head_dim; ++d) row[d] = Bf16ToFloat(kb[d]);
        kr = row.data();
      }
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * kr[d];
      out[static_cast<size_t>(h) * n + j] = dot * scale;
    }
  }
}

}  // namespace infinigen
