// The math and semantics of KV selection on hand-made inputs: skew invariance and the
// eigen-solver, per-head top-k, GQA aggregation, InfiniGen's alpha margin and budget clamp,
// window and oracle choices, and the sidecar file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iterator>
#include <random>
#include <tuple>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/selection_util.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/infinigen/skew.h"

namespace infinigen {
namespace {

TEST(Skew, EigenvectorsAreOrthonormalAndReconstructTheMatrix) {
  const int n = 9;
  std::mt19937 rng(3);
  std::normal_distribution<double> d;
  std::vector<double> m(n * n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) m[i * n + j] = m[j * n + i] = d(rng);
  }
  std::vector<double> v;
  const auto values = SymmetricEigen(m, n, v);
  for (int i = 1; i < n; ++i) EXPECT_GE(values[i - 1], values[i]);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      double dot = 0, rec = 0;
      for (int k = 0; k < n; ++k) {
        dot += v[k * n + a] * v[k * n + b];
        rec += v[a * n + k] * values[k] * v[b * n + k];
      }
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-10);
      EXPECT_NEAR(rec, m[a * n + b], 1e-9);
    }
  }
}

TEST(Skew, RotatingQueriesAndKeysKeepsTheirProducts) {
  const int d = 12;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  GramAccumulator gram(d);
  std::vector<float> q(30 * d), k(30 * d);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  for (int r = 0; r < 30; ++r) gram.Add(q.data() + r * d);
  const auto a = SkewFromGram(gram);
  auto rotate = [&](const float* x, std::vector<double>& out) {
    out.assign(d, 0.0);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) out[j] += x[i] * a[i * d + j];
    }
  };
  std::vector<double> qa, ka;
  for (int r = 0; r < 30; ++r) {
    rotate(q.data() + r * d, qa);
    rotate(k.data() + r * d, ka);
    double plain = 0, skewed = 0;
    for (int i = 0; i < d; ++i) {
      plain += double(q[r * d + i]) * k[r * d + i];
      skewed += qa[i] * ka[i];
    }
    EXPECT_NEAR(plain, skewed, 1e-4 * (1 + std::abs(plain)));
  }
  // Skewing concentrates the queries: the first rotated channel carries the most energy.
  ChannelScores scores(d, a);
  for (int r = 0; r < 30; ++r) scores.AddQuery(q.data() + r * d);
  EXPECT_EQ(scores.Top(1)[0], 0);
}

TEST(SelectionUtil, TopKKeepsForcedSlotsAndIsSorted) {
  const float scores[] = {0.1f, 0.9f, 0.5f, 0.9f, 0.0f, 0.7f};
  std::vector<int32_t> out;
  TopK(scores, 6, 3, {4}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 3, 4}));  // 4 forced, then 0.9 (slot 1) and 0.9 (3)
  out.clear();
  TopK(scores, 6, 2, {}, out);
  EXPECT_EQ(out, (std::vector<int32_t>{1, 3}));  // tie at 0.9 keeps both; lower slot first
}

// The slots TopK must choose, by ranking every slot by (score descending, slot ascending) after
// the forced ones; ascending.
std::vector<int32_t> RankedTopK(const std::vector<float>& scores,
                                const std::vector<int32_t>& forced, int64_t k) {
  const int64_t n = static_cast<int64_t>(scores.size());
  std::vector<int32_t> want;
  for (int32_t f : forced) {
    if (f >= 0 && f < n && static_cast<int64_t>(want.size()) < k &&
        std::find(want.begin(), want.end(), f) == want.end()) {
      want.push_back(f);
    }
  }
  std::vector<char> is_forced(static_cast<size_t>(n), 0);
  for (int32_t f : want) is_forced[f] = 1;
  std::vector<int32_t> rest;
  for (int32_t j = 0; j < n; ++j) {
    if (!is_forced[j]) rest.push_back(j);
  }
  // Higher first, NaN below everything (even -inf); stable: ties keep the lower slot first.
  std::stable_sort(rest.begin(), rest.end(), [&](int32_t a, int32_t b) {
    const float x = scores[a], y = scores[b];
    if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
    return x > y;
  });
  for (int32_t j : rest) {
    if (static_cast<int64_t>(want.size()) >= std::min(k, n)) break;
    want.push_back(j);
  }
  std::sort(want.begin(), want.end());
  return want;
}

void ExpectTopKEqualsRanking(const std::vector<float>& scores, const std::vector<int32_t>& forced,
                             int64_t k, int trial) {
  const int64_t n = static_cast<int64_t>(scores.size());
  const std::vector<int32_t> want = RankedTopK(scores, forced, k);
  std::vector<int32_t> got = {-5};  // appended after what is there
  TopK(scores.data(), n, k, forced, got);
  ASSERT_EQ(got.front(), -5);
  got.erase(got.begin());
  std::vector<int32_t> only_got, only_want;
  std::set_difference(got.begin(), got.end(), want.begin(), want.end(),
                      std::back_inserter(only_got));
  std::set_difference(want.begin(), want.end(), got.begin(), got.end(),
                      std::back_inserter(only_want));
  ASSERT_EQ(got, want) << "trial " << trial << ": n " << n << ", k " << k << "; " << got.size()
                       << " vs " << want.size() << " slots; first only chosen "
                       << (only_got.empty() ? -1 : only_got[0]) << " (score "
                       << (only_got.empty() ? 0.0f : scores[only_got[0]])
                       << "), first only expected " << (only_want.empty() ? -1 : only_want[0])
                       << " (score " << (only_want.empty() ? 0.0f : scores[only_want[0]]) << ")";
}

// The radix-select top-k against ranking every slot by (score descending, slot ascending), on
// random scores with many ties, NaN and infinities, forced slots (repeated, out of range, more
// than k) and k from 1 to past n.
TEST(SelectionUtil, TopKEqualsAFullRankingOnRandomScores) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t n = 1 + rng() % 300;
    std::vector<float> scores(n);
    const int levels = 1 + rng() % 20;  // few distinct values: many ties
    for (float& v : scores) {
      const int r = rng() % 100;
      v = r < 3    ? NAN
          : r < 5  ? INFINITY
          : r < 7  ? -INFINITY
          : r < 10 ? -0.0f
                   : static_cast<float>(static_cast<int>(rng() % levels) - levels / 2) * 0.37f;
    }
    std::vector<int32_t> forced;
    for (int f = rng() % 4; f > 0; --f) forced.push_back(static_cast<int32_t>(rng() % (n + 3)) - 1);
    if (!forced.empty() && rng() % 2) forced.push_back(forced[0]);
    const int64_t k = 1 + rng() % (n + 5);
    ASSERT_NO_FATAL_FAILURE(ExpectTopKEqualsRanking(scores, forced, k, trial));
  }
}

// The same at a long sequence's sizes, where the select counts the first digit in several
// histograms and moves keys eight at a time: group masses (positive, a few exponents: most keys
// share a first digit), a sequence's masses with a block of equal values around the k-th, NaN
// among them, and the current slot forced.
TEST(SelectionUtil, TopKEqualsAFullRankingAtLongSequenceSizes) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int trial = 0; trial < 24; ++trial) {
    const int64_t n = 8192 + rng() % 40000;
    std::vector<float> scores(n);
    for (float& v : scores) v = std::exp(normal(rng)) / static_cast<float>(n);
    const int64_t k = trial % 5 == 4 ? n - static_cast<int64_t>(rng() % 20)
                                     : 1 + static_cast<int64_t>(rng() % (n / 3));
    if (trial % 3 == 1) {  // 40 more slots equal to the k-th largest: the top k cuts the ties
      std::vector<float> sorted = scores;
      std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<>());
      for (int t = 0; t < 40; ++t) scores[rng() % n] = sorted[k - 1];
    }
    if (trial % 4 == 2) {
      for (int t = 0; t < 30; ++t) scores[rng() % n] = NAN;
    }
    std::vector<int32_t> forced;
    if (trial % 2 == 0) forced.push_back(static_cast<int32_t>(n - 1));
    ASSERT_NO_FATAL_FAILURE(ExpectTopKEqualsRanking(scores, forced, k, trial));
  }
}

// The group mass against softmax in double precision with std::exp, on odd sizes (vector tails)
// and scores far below the maximum (exponentials that underflow to zero).
TEST(SelectionUtil, GroupMassAgreesWithADoublePrecisionSoftmax) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 6.0f);
  for (const auto [heads, kv_heads, n] : {std::tuple{4, 2, 1}, std::tuple{8, 2, 37},
                                          std::tuple{6, 3, 1001}, std::tuple{32, 8, 70000}}) {
    std::vector<float> s(static_cast<size_t>(heads) * n);
    for (float& v : s) v = normal(rng);
    s[n / 2] = -500.0f;
    std::vector<float> mass;
    GroupAttentionMass(s.data(), heads, kv_heads, n, mass);
    std::vector<double> want(static_cast<size_t>(kv_heads) * n, 0.0);
    const int group = heads / kv_heads;
    for (int h = 0; h < heads; ++h) {
      const float* row = s.data() + static_cast<size_t>(h) * n;
      const double mx = *std::max_element(row, row + n);
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += std::exp(row[j] - mx);
      for (int64_t j = 0; j < n; ++j) want[(h / group) * n + j] += std::exp(row[j] - mx) / sum;
    }
    ASSERT_EQ(mass.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(mass[i], want[i], 1e-6 + 2e-5 * want[i]) << "n " << n << ", index " << i;
    }
  }
}

TEST(SelectionUtil, GroupMassSumsSoftmaxOfTheGroupsHeads) {
  // 4 heads, 2 KV heads, 2 rows.
  const float s[] = {0, 0, std::log(3.0f), 0, 0, 100, 100, 0};
  std::vector<float> mass;
  GroupAttentionMass(s, 4, 2, 2, mass);
  EXPECT_NEAR(mass[0], 0.5 + 0.75, 1e-6);
  EXPECT_NEAR(mass[1], 0.5 + 0.25, 1e-6);
  EXPECT_NEAR(mass[2], 0.0 + 1.0, 1e-6);
  EXPECT_NEAR(mass[3], 1.0 + 0.0, 1e-6);
}

// A 2-layer model with 4 query heads, 2 KV heads, head_dim 2 and an identity skew keeping both
// channels: speculated scores are then plain q·k / sqrt(2).
struct TinySetup {
  ModelConfig model;
  InfinigenSidecar sidecar;
  TinySetup() {
    model.num_layers = 2;
    model.num_heads = 4;
    model.num_kv_heads = 2;
    model.head_dim = 2;
    sidecar.num_layers = 2;
    sidecar.num_kv_heads = 2;
    sidecar.head_dim = 2;
    sidecar.partial_dim = 2;
    for (int l = 0; l < 2; ++l) {
      sidecar.skew.push_back({1, 0, 0, 1, 1, 0, 0, 1});
      sidecar.channels.push_back({0, 1, 0, 1});
    }
  }
};

// Stores `keys` ([n, 2 heads x 2]) at layer 1 with slot == position and selects for query q.
Selection RunInfinigen(KvSelectionPolicy& policy, const std::vector<float>& keys,
                       const std::vector<float>& q) {
  const int64_t n = static_cast<int64_t>(keys.size() / 4);
  std::vector<int32_t> slots(n * 2);
  for (int64_t t = 0; t < n; ++t) slots[2 * t] = slots[2 * t + 1] = static_cast<int32_t>(t);
  LayerKeys k;
  k.seq = 1;
  k.layer = 1;
  k.count = n;
  k.k = keys.data();
  k.k_stride = 4;
  k.slots = slots.data();
  EXPECT_TRUE(policy.OnKeys(k).ok());
  SelectRequest r;
  r.seq = 1;
  r.layer = 1;
  r.position = n - 1;
  const int32_t current[2] = {static_cast<int32_t>(n - 1), static_cast<int32_t>(n - 1)};
  r.current_slots = current;
  r.kv.num_slots = n;
  r.q = q.data();
  r.speculated_q = q.data();
  Selection sel;
  EXPECT_TRUE(policy.Select(r, sel).ok());
  return sel;
}

TEST(InfinigenPolicy, AlphaMarginCountsAndBudgetClamps) {
  TinySetup t;
  // Keys of KV head 0 along channel 0 with logits 10, 9.5, 2, 1 (scaled by 1/sqrt(2)); KV head 1
  // along channel 1 with 10, 2, 1, 0.5. Position 4 (current) is a weak key for both heads.
  const float s2 = std::sqrt(2.0f);
  std::vector<float> keys = {10 * s2, 0,      0, 10 * s2, 9.5f * s2, 0, 0, 2 * s2, 2 * s2, 0, 0,
                             1 * s2,  1 * s2, 0, 0,       0.5f * s2, 0, 0, 0,      0};
  std::vector<float> q = {1, 0, 1, 0, 0, 1, 0, 1};  // heads 0,1 -> KV 0; heads 2,3 -> KV 1
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  config.dense_layers = 1;
  config.alpha = 1.0;  // head on KV 0 counts {10, 9.5} = 2, head on KV 1 counts {10} = 1
  config.budget_fraction = 1.0;
  auto policy = MakeSelectionPolicy(config, t.model, &t.sidecar);
  ASSERT_TRUE(policy.ok()) << policy.status();
  Selection sel = RunInfinigen(**policy, keys, q);
  ASSERT_FALSE(sel.all);
  EXPECT_EQ(sel.count, 2);  // round(mean(2, 2, 1, 1)) = round(1.5) = 2
  // KV head 0: the current token (slot 4) is forced, then the top mass (slot 0).
  EXPECT_EQ(std::vector<int32_t>(sel.indices.begin(), sel.indices.begin() + 2),
            (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(std::vector<int32_t>(sel.indices.begin() + 2, sel.indices.end()),
            (std::vector<int32_t>{0, 4}));

  // A wide margin wants everything; a 40% budget caps k at 2 of 5.
  config.alpha = 100.0;
  config.budget_fraction = 0.4;
  auto capped = MakeSelectionPolicy(config, t.model, &t.sidecar);
  Selection c = RunInfinigen(**capped, keys, q);
  ASSERT_FALSE(c.all);
  EXPECT_EQ(c.count, 2);

  // Budget 100% and an unbounded margin: every row, the dense result.
  config.budget_fraction = 1.0;
  auto all = MakeSelectionPolicy(config, t.model, &t.sidecar);
  EXPECT_TRUE(RunInfinigen(**all, keys, q).all);
}

// Keys stored in uneven appends that cross the partial key cache's chunk boundaries (1024
// rows) are scored where they were stored: the planted strong keys on either side of each
// boundary are exactly what is selected.
TEST(InfinigenPolicy, KeysAcrossChunkBoundariesAreScoredWhereTheyWereStored) {
  TinySetup t;
  constexpr int64_t n = 2600;
  const std::vector<int32_t> strong0 = {0, 511, 1023, 1024, 2047, 2048};
  const std::vector<int32_t> strong1 = {1, 1025, 2046, 2049, 2100, 2598};
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> weak(-1.0f, 1.0f);
  std::vector<float> keys(n * 4);
  for (float& k : keys) k = weak(rng);
  for (int32_t j : strong0) keys[j * 4 + 0] = 50.0f;  // KV head 0, channel 0
  for (int32_t j : strong1) keys[j * 4 + 3] = 50.0f;  // KV head 1, channel 1
  std::vector<int32_t> slots(n * 2);
  for (int64_t j = 0; j < n; ++j) slots[2 * j] = slots[2 * j + 1] = static_cast<int32_t>(j);

  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  config.dense_layers = 1;
  config.alpha = 100.0;
  config.budget_tokens = 7;  // the six strong keys and the current token
  auto policy = MakeSelectionPolicy(config, t.model, &t.sidecar);
  ASSERT_TRUE(policy.ok()) << policy.status();
  int64_t stored = 0;
  for (int64_t piece : {700, 400, 1, 1000, 499}) {
    LayerKeys k;
    k.seq = 1;
    k.layer = 1;
    k.count = piece;
    k.k = keys.data() + stored * 4;
    k.k_stride = 4;
    k.slots = slots.data() + stored * 2;
    ASSERT_TRUE((*policy)->OnKeys(k).ok());
    stored += piece;
  }
  ASSERT_EQ(stored, n);
  const std::vector<float> q = {1, 0, 1, 0, 0, 1, 0, 1};
  SelectRequest r;
  r.seq = 1;
  r.layer = 1;
  r.position = n - 1;
  const int32_t current[2] = {n - 1, n - 1};
  r.current_slots = current;
  r.kv.num_slots = n;
  r.q = q.data();
  r.speculated_q = q.data();
  Selection sel;
  ASSERT_TRUE((*policy)->Select(r, sel).ok());
  ASSERT_FALSE(sel.all);
  ASSERT_EQ(sel.count, 7);
  std::vector<int32_t> want0 = strong0, want1 = strong1;
  want0.push_back(n - 1);
  want1.push_back(n - 1);
  std::sort(want1.begin(), want1.end());
  EXPECT_EQ(std::vector<int32_t>(sel.indices.begin(), sel.indices.begin() + 7), want0);
  EXPECT_EQ(std::vector<int32_t>(sel.indices.begin() + 7, sel.indices.end()), want1);
}

// What InfiniGen asks of a backend the host cannot read (Backend::AppendPartialKeys and
// ChooseRows), done by CpuBackend, chooses the host policy's rows exactly: the prefetch's
// candidates over the stored rows (with the margin) and the layer's own choice with the current
// token, at Llama-3.1-8B's attention shape over 3000 rows appended in uneven pieces (the host
// cache's 1024-row chunks are crossed; the backend's cache is one block). The CUDA kernels are
// held to CpuBackend's choice in cuda_backend_test.
TEST(InfinigenPolicy, TheCpuBackendsChoiceIsTheHostPolicys) {
  constexpr int kHeads = 32, kKvHeads = 8, kDim = 128, kPartial = 26;
  constexpr int64_t n = 3000;
  ModelConfig model;
  model.num_layers = 2;
  model.num_heads = kHeads;
  model.num_kv_heads = kKvHeads;
  model.head_dim = kDim;
  InfinigenSidecar sidecar;
  sidecar.num_layers = 2;
  sidecar.num_kv_heads = kKvHeads;
  sidecar.head_dim = kDim;
  sidecar.partial_dim = kPartial;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int l = 0; l < 2; ++l) {
    std::vector<float> skew(static_cast<size_t>(kKvHeads) * kDim * kDim);
    for (float& x : skew) x = normal(rng) * 0.1f;
    sidecar.skew.push_back(std::move(skew));
    std::vector<int32_t> channels;
    for (int g = 0; g < kKvHeads; ++g) {
      for (int c = 0; c < kPartial; ++c) channels.push_back((c * 5 + g) % kDim);
    }
    sidecar.channels.push_back(std::move(channels));
  }
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  config.dense_layers = 1;
  config.alpha = 4.0;
  config.budget_fraction = 0.2;
  auto policy = MakeSelectionPolicy(config, model, &sidecar);
  ASSERT_TRUE(policy.ok()) << policy.status();
  const int64_t width = kKvHeads * kDim;
  std::vector<float> keys((n + 1) * width), q(kHeads * kPartial);
  for (float& x : keys) x = normal(rng);
  for (float& x : q) x = normal(rng) * 3.0f;
  std::vector<int32_t> slots((n + 1) * kKvHeads);
  for (int64_t t = 0; t <= n; ++t) {
    std::fill_n(slots.begin() + t * kKvHeads, kKvHeads, static_cast<int32_t>(t));
  }
  CpuBackend cpu;
  const PartialKeysShape shape{kKvHeads, kDim, kPartial, n + 7};
  std::vector<uint16_t> backend_keys(shape.Bytes() / 2);
  const std::vector<float> skew = sidecar.PartialSkew(1);
  int64_t stored = 0;
  auto append = [&](int64_t count) {
    LayerKeys k;
    k.seq = 1;
    k.layer = 1;
    k.start = stored;
    k.count = count;
    k.k = keys.data() + stored * width;
    k.k_stride = width;
    k.slots = slots.data() + stored * kKvHeads;
    ASSERT_TRUE((*policy)->OnKeys(k).ok());
    const MatView rows{keys.data() + stored * width, DType::kF32, count, width, width};
    ASSERT_TRUE(cpu.AppendPartialKeys(rows, skew.data(), shape, backend_keys.data(), stored).ok());
    stored += count;
  };
  for (int64_t piece : {700, 400, 1, 1000, 899}) append(piece);
  ASSERT_EQ(stored, n);
  auto choose = [&](int64_t rows, bool prefetch, Selection& out) {
    const int64_t k_max = config.Budget(prefetch ? rows + 1 : rows);
    const int64_t capacity = std::min(rows, k_max + 3 + k_max / 16);
    std::vector<int32_t> indices(kKvHeads * capacity);
    int32_t count = 0;
    RowChoiceRequest r;
    r.q_partial = {q.data(), DType::kF32, 1, kHeads * kPartial, kHeads * kPartial};
    r.keys = backend_keys.data();
    r.keys_shape = shape;
    r.num_heads = kHeads;
    r.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    r.alpha = static_cast<float>(config.alpha);
    r.rows = rows;
    r.k_min = 1;
    r.k_max = k_max;
    r.margin = prefetch;
    r.force_last = !prefetch;
    r.indices = indices.data();
    r.index_capacity = capacity;
    r.count = &count;
    ASSERT_TRUE(cpu.ChooseRows(r, nullptr).ok());
    out.all = false;
    out.count = count;
    out.indices.clear();
    for (int g = 0; g < kKvHeads; ++g) {
      out.indices.insert(out.indices.end(), indices.begin() + g * capacity,
                         indices.begin() + g * capacity + count);
    }
  };
  SelectRequest r;
  r.seq = 1;
  r.layer = 1;
  r.position = n;
  r.kv.num_slots = n;
  r.speculated_q = q.data();
  Selection host, backend;
  ASSERT_TRUE((*policy)->Preselect(r, host));
  choose(n, /*prefetch=*/true, backend);
  ASSERT_FALSE(host.all);
  EXPECT_LT(host.count, n / 4);
  EXPECT_EQ(backend.count, host.count);
  EXPECT_EQ(backend.indices, host.indices);

  append(1);  // the current token
  const int32_t current[kKvHeads] = {n, n, n, n, n, n, n, n};
  r.current_slots = current;
  r.kv.num_slots = n + 1;
  r.q = q.data();  // unused: the speculated query decides
  ASSERT_TRUE((*policy)->Select(r, host).ok());
  choose(n + 1, /*prefetch=*/false, backend);
  ASSERT_FALSE(host.all);
  EXPECT_EQ(backend.count, host.count);
  EXPECT_EQ(backend.indices, host.indices);
}

TEST(InfinigenPolicy, NeedsItsSidecar) {
  TinySetup t;
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  EXPECT_EQ(MakeSelectionPolicy(config, t.model, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto magic = ParsePolicyKind("magic");
  EXPECT_EQ(magic.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(magic.status().message().find("full, infinigen, h2o, window or oracle"),
            std::string::npos);
  for (PolicyKind k : {PolicyKind::kFull, PolicyKind::kInfinigen, PolicyKind::kH2o,
                       PolicyKind::kWindow, PolicyKind::kOracle}) {
    EXPECT_EQ(ParsePolicyKind(PolicyKindName(k)).value(), k);
  }
}

TEST(SelectionConfig, BudgetIsAFractionOrACountClampedToTheRows) {
  SelectionConfig c;
  c.budget_fraction = 0.2;
  EXPECT_EQ(c.Budget(100), 20);
  EXPECT_EQ(c.Budget(3), 1);
  c.budget_tokens = 50;
  EXPECT_EQ(c.Budget(100), 50);
  EXPECT_EQ(c.Budget(10), 10);
}

TEST(SelectionConfig, RequestOverridesStayWithinTheServersLimits) {
  SelectionConfig defaults;
  defaults.policy = PolicyKind::kInfinigen;
  SelectionLimits limits;
  limits.allowed_policies = {PolicyKind::kInfinigen, PolicyKind::kFull};
  SelectionOverrides o;
  o.budget_fraction = 0.3;
  o.alpha = 8.0;
  auto c = ApplyOverrides(defaults, o, limits);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->budget_fraction, 0.3);
  EXPECT_EQ(c->alpha, 8.0);
  EXPECT_EQ(c->policy, PolicyKind::kInfinigen);
  o = {};
  o.budget_fraction = 0.01;
  auto low = ApplyOverrides(defaults, o, limits);
  EXPECT_EQ(low.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(low.status().message().find("0.05"), std::string::npos) << low.status();
  o = {};
  o.policy = PolicyKind::kOracle;
  EXPECT_NE(ApplyOverrides(defaults, o, limits).status().message().find("not allowed"),
            std::string::npos);
  o = {};
  o.alpha = 100.0;
  EXPECT_EQ(ApplyOverrides(defaults, o, limits).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen
