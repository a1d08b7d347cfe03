// TopK: the k best slots of one KV head's scores by radix select, with no sort and no branch a
// key (kernels/cpu/selection.h declares it; the host policies and CpuBackend::ChooseRows call
// it, and it is the oracle of the CUDA top-k).
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels/cpu/selection.h"

namespace infinigen::cpu {
namespace {

// An unsigned key in the order of the floats (NaN lowest; -0 equal to +0, as the floats are).
inline uint32_t OrderKey(float v) {
  const uint32_t b = std::bit_cast<uint32_t>(v + 0.0f);  // -0 + 0 = +0
  const uint32_t key = (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
  return v == v ? key : 0u;
}

// Radix select's digits, highest first: 11, 11 and 10 bits of a 32-bit key.
constexpr int kDigitShift[3] = {21, 10, 0};
constexpr uint32_t kDigitMask[3] = {(1u << 11) - 1, (1u << 11) - 1, (1u << 10) - 1};
using DigitHistogram = int32_t[1 << 11];

// The digit, counted from the highest, that holds the rank-th largest key (1-based) given the
// histogram of one pass; rank becomes the rank within that digit.
inline uint32_t DigitOfRank(const DigitHistogram& hist, uint32_t mask, int64_t& rank) {
  uint32_t digit = mask;
  while (rank > hist[digit]) rank -= hist[digit--];
  return digit;
}

#if defined(__AVX2__)
// The lanes of the set bits of an 8-bit mask, in order, first in a vector (the rest unspecified):
// the permutation that packs the lanes a compare kept to the front.
inline __m256i CompressLanes(int mask) {
  static const std::array<uint32_t, 256> kPacked = [] {
    std::array<uint32_t, 256> table{};
    for (uint32_t m = 0; m < 256; ++m) {
      int at = 0;
      for (uint32_t bit = 0; bit < 8; ++bit) {
        if ((m >> bit) & 1) table[m] |= bit << (4 * at++);
      }
    }
    return table;
  }();
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(kPacked[mask])),
                                            _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                          _mm256_set1_epi32(15));
}
#endif

// Copies to `to`, in order, the keys of `from` whose digit (key >> shift) & mask is `digit`;
// returns how many. `to` may be `from`.
int64_t KeepDigit(const uint32_t* from, int64_t size, int shift, uint32_t mask, uint32_t digit,
                  uint32_t* to) {
  int64_t kept = 0, i = 0;
#if defined(__AVX2__)
  const __m256i mask_v = _mm256_set1_epi32(static_cast<int32_t>(mask));
  const __m256i digit_v = _mm256_set1_epi32(static_cast<int32_t>(digit));
  const __m128i shift_v = _mm_cvtsi32_si128(shift);
  for (; i + 8 <= size; i += 8) {  // to + kept + 8 <= from + i + 8: nothing unread is written
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i));
    const __m256i d = _mm256_and_si256(_mm256_srl_epi32(v, shift_v), mask_v);
    const int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(d, digit_v)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + kept),
                        _mm256_permutevar8x32_epi32(v, CompressLanes(m)));
    kept += std::popcount(static_cast<unsigned>(m));
  }
#endif
  for (; i < size; ++i) {
    const uint32_t key = from[i];
    to[kept] = key;
    kept += ((key >> shift) & mask) == digit;
  }
  return kept;
}

// The rank-th largest of the n keys (1-based, rank <= n), by radix select, and in *ties how many
// keys equal to it are within the top `rank`. `first` is the histogram of the keys' first digit
// (CountFirstDigits); `spare` takes the keys of each chosen digit
// (room for n). Branch-free passes: which keys a digit keeps is data the branch predictor
// cannot learn (a branch a key cost a misprediction for a tenth to a half of them).
uint32_t RadixSelect(const uint32_t* keys, int64_t n, const DigitHistogram& first, int64_t rank,
                     uint32_t* spare, int64_t* ties) {
  uint32_t digit = DigitOfRank(first, kDigitMask[0], rank);
  uint32_t prefix = digit << kDigitShift[0];
  const uint32_t* from = keys;
  int64_t size = n;
  for (int pass = 1; pass < 3; ++pass) {
    // The keys of the digit chosen so far, and the histogram of their next digit.
    const int shift = kDigitShift[pass - 1], next_shift = kDigitShift[pass];
    const uint32_t next_mask = kDigitMask[pass];
    const int64_t kept = KeepDigit(from, size, shift, kDigitMask[pass - 1], digit, spare);
    DigitHistogram hist = {};
    for (int64_t i = 0; i < kept; ++i) ++hist[(spare[i] >> next_shift) & next_mask];
    from = spare;
    size = kept;
    digit = DigitOfRank(hist, next_mask, rank);
    prefix |= digit << next_shift;
  }
  *ties = rank;
  return prefix;
}

// The histogram of the keys' first digit, counted in four histograms summed at the end: keys of
// a similar value (a sequence's masses share a few exponents) would otherwise add to one counter
// back to back, each add waiting for the last one's store.
void CountFirstDigits(const uint32_t* keys, int64_t n, DigitHistogram& hist) {
  const int64_t bins = int64_t{1} << 11;
  if (n < 4 * bins) {
    for (int64_t j = 0; j < n; ++j) ++hist[keys[j] >> kDigitShift[0]];
    return;
  }
  thread_local std::vector<int32_t> ways;
  ways.assign(static_cast<size_t>(3 * bins), 0);
  int32_t* const w = ways.data();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    ++hist[keys[j] >> kDigitShift[0]];
    ++w[keys[j + 1] >> kDigitShift[0]];
    ++w[bins + (keys[j + 2] >> kDigitShift[0])];
    ++w[2 * bins + (keys[j + 3] >> kDigitShift[0])];
  }
  for (; j < n; ++j) ++hist[keys[j] >> kDigitShift[0]];
  for (int64_t b = 0; b < bins; ++b) hist[b] += w[b] + w[bins + b] + w[2 * bins + b];
}

// Appends to out the slots j < n, in order, whose key is above kth, and the first `ties` of those
// equal to it, until `need` are there; returns how many. out has room for need + 8.
int64_t TakeAbove(const uint32_t* key, int64_t n, uint32_t kth, int64_t ties, int64_t need,
                  int32_t* out) {
  int64_t taken = 0, j = 0;
#if defined(__AVX2__)
  // Eight keys at a time: a compare, and the indices of the keys above kth moved to the front of
  // a vector by a permutation looked up by the compare's mask (a branch a key mispredicted for a
  // fifth of them). Groups with a key equal to kth (one in a sequence's 8 192, mostly) go on
  // one key at a time.
  const __m256i flip = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  const __m256i kth_flipped = _mm256_xor_si256(_mm256_set1_epi32(static_cast<int32_t>(kth)), flip);
  const __m256i kth_v = _mm256_set1_epi32(static_cast<int32_t>(kth));
  for (; j + 8 <= n && taken < need; j += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + j));
    const int equal = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, kth_v)));
    if (equal != 0) {
      for (int64_t i = j; i < j + 8 && taken < need; ++i) {
        if (key[i] > kth || (key[i] == kth && ties-- > 0)) out[taken++] = static_cast<int32_t>(i);
      }
      continue;
    }
    const __m256i above = _mm256_cmpgt_epi32(_mm256_xor_si256(v, flip), kth_flipped);
    const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(above));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + taken),
        _mm256_add_epi32(CompressLanes(mask), _mm256_set1_epi32(static_cast<int32_t>(j))));
    taken += std::popcount(static_cast<unsigned>(mask));
  }
#endif
  for (; j < n && taken < need; ++j) {
    if (key[j] > kth || (key[j] == kth && ties-- > 0)) out[taken++] = static_cast<int32_t>(j);
  }
  return taken;
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
  thread_local std::vector<uint32_t> keys, spare;
  thread_local std::vector<int32_t> taken;
  int64_t num_taken = 0;
  if (need > 0) {
    keys.resize(static_cast<size_t>(n));
    spare.resize(static_cast<size_t>(n));
    taken.resize(static_cast<size_t>(need + 8));
    uint32_t* const key = keys.data();
    for (int64_t j = 0; j < n; ++j) key[j] = OrderKey(scores[j]);
    for (int32_t f : chosen) key[f] = 0;
    DigitHistogram first = {};
    CountFirstDigits(key, n, first);
    int64_t ties = 0;
    const uint32_t kth = RadixSelect(key, n, first, need, spare.data(), &ties);
    if (kth > 0 || chosen.empty()) {  // forced slots hold key 0 < kth: never taken here
      num_taken = TakeAbove(key, n, kth, ties, need, taken.data());
    } else {  // the kth is a NaN's key, which the forced slots share: skip them by slot
      size_t next_forced = 0;
      for (int64_t j = 0; j < n && num_taken < need; ++j) {
        if (next_forced < chosen.size() && chosen[next_forced] == j) {
          ++next_forced;
          continue;
        }
        if (key[j] > kth || ties-- > 0) taken[num_taken++] = static_cast<int32_t>(j);
      }
    }
  }
  std::merge(chosen.begin(), chosen.end(), taken.begin(), taken.begin() + num_taken, out);
  return num_forced + num_taken;
}

}  // namespace infinigen::cpu
