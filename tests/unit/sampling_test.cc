#include "kernels/cpu/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <vector>

#include "kernels/cpu/philox.h"

namespace infinigen {
namespace {

TEST(Philox, MatchesRandom123KnownAnswers) {
  Philox4x32 zero = Philox4x32_10(0, 0, 0);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  Philox4x32 ones = Philox4x32_10(~0ull, ~0ull, ~0ull);
  EXPECT_EQ(ones.v[0], 0x408f276du);
  EXPECT_EQ(ones.v[1], 0x41c83b0eu);
  EXPECT_EQ(ones.v[2], 0xa20bc7c6u);
  EXPECT_EQ(ones.v[3], 0x6d5451fdu);
}

std::vector<float> LogitsFromProbs(const std::vector<double>& p) {
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  return l;
}

int32_t Sample(std::vector<float> logits, const SamplingParams& params, uint64_t position,
               const std::vector<int32_t>& history = {}, size_t prompt_tokens = 0) {
  SamplingScratch scratch;
  return SampleToken(logits, params, history,
                     std::span<const int32_t>(history).subspan(prompt_tokens), position, scratch);
}

// Frequencies of each token over `n` positions.
std::map<int32_t, double> Frequencies(const std::vector<float>& logits, const SamplingParams& p,
                                      int n) {
  std::map<int32_t, double> f;
  for (int i = 0; i < n; ++i) f[Sample(logits, p, static_cast<uint64_t>(i))] += 1.0 / n;
  return f;
}

TEST(Sampling, GreedyPicksArgmaxAndLowestIdOnTies) {
  SamplingParams p;
  p.temperature = 0.0f;
  EXPECT_EQ(Sample({0.1f, 3.0f, -1.0f, 2.9f}, p, 0), 1);
  EXPECT_EQ(Sample({1.0f, 5.0f, 5.0f}, p, 7), 1);
}

TEST(Sampling, SameSeedAndPositionGiveSameToken) {
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[i] = std::sin(i * 0.7f);
  SamplingParams p;
  p.seed = 42;
  for (uint64_t pos = 0; pos < 50; ++pos) EXPECT_EQ(Sample(logits, p, pos), Sample(logits, p, pos));
  int differ = 0;
  SamplingParams q = p;
  q.seed = 43;
  for (uint64_t pos = 0; pos < 50; ++pos)
    differ += Sample(logits, p, pos) != Sample(logits, q, pos);
  EXPECT_GT(differ, 25);  // ~99% of draws differ between seeds over 100 near-uniform tokens
}

TEST(Sampling, FrequenciesFollowTemperatureScaledSoftmax) {
  const std::vector<double> probs = {0.5, 0.3, 0.15, 0.05};
  const auto logits = LogitsFromProbs(probs);
  SamplingParams p;
  p.temperature = 2.0f;
  auto f = Frequencies(logits, p, 20000);
  double z = 0;
  for (double x : probs) z += std::sqrt(x);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(f[i], std::sqrt(probs[i]) / z, 0.015) << i;
}

TEST(Sampling, TopKTopPAndMinPRestrictTheCandidates) {
  const auto logits = LogitsFromProbs({0.5, 0.3, 0.15, 0.05});
  SamplingParams p;
  p.top_k = 2;
  auto f = Frequencies(logits, p, 5000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[0], 0.5 / 0.8, 0.03);

  SamplingParams q;
  q.top_p = 0.7f;  // 0.5 < 0.7 <= 0.8: tokens 0 and 1
  f = Frequencies(logits, q, 5000);
  EXPECT_EQ(f.size(), 2u);

  SamplingParams m;
  m.min_p = 0.5f;  // keep p >= 0.25
  f = Frequencies(logits, m, 5000);
  EXPECT_EQ(f.size(), 2u);

  SamplingParams k1;
  k1.top_k = 1;
  for (uint64_t pos = 0; pos < 100; ++pos) EXPECT_EQ(Sample(logits, k1, pos), 0);
}

TEST(Sampling, TopKKeepsTiesWithTheKth) {
  SamplingParams p;
  p.top_k = 1;
  auto f = Frequencies({2.0f, 2.0f, -5.0f}, p, 4000);
  EXPECT_EQ(f.size(), 2u);
  EXPECT_NEAR(f[0], 0.5, 0.04);
}

TEST(Sampling, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogits) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.repetition_penalty = 2.0f;
  // Token 0 (logit 3) was seen: 3 / 2 = 1.5 < 2, so token 1 wins.
  EXPECT_EQ(Sample({3.0f, 2.0f, -1.0f}, p, 0, {0, 0}), 1);
  // Negative logits of seen tokens get more negative: -0.5 * 2 = -1 < -0.8.
  EXPECT_EQ(Sample({-0.5f, -0.8f}, p, 0, {0}), 1);
  EXPECT_EQ(Sample({-0.5f, -0.8f}, p, 0, {}), 0);
  // One scratch for a sequence of calls, as a worker keeps it: each call penalizes its own
  // history only (the marks of the one before are gone).
  SamplingScratch scratch;
  std::vector<float> logits = {3.0f, 2.0f, -1.0f};
  const std::vector<int32_t> first = {0, 2, 0};
  EXPECT_EQ(SampleToken(logits, p, first, {}, 0, scratch), 1);
  logits = {3.0f, 2.0f, -1.0f};
  const std::vector<int32_t> second = {2, 0};
  EXPECT_EQ(SampleToken(logits, p, second, {}, 0, scratch), 1);
  EXPECT_EQ(logits, (std::vector<float>{1.5f, 2.0f, -2.0f}));
}

// OpenAI's formula, written out: logit - frequency x count - presence x (count > 0), counting the
// generated tokens only.
std::vector<float> PenalizedByOpenAisFormula(std::vector<float> logits,
                                             const std::vector<int32_t>& output, float presence,
                                             float frequency) {
  std::map<int32_t, int> count;
  for (int32_t t : output) count[t] += 1;
  for (const auto& [t, c] : count) logits[t] -= frequency * c + presence * (c > 0 ? 1.0f : 0.0f);
  return logits;
}

TEST(Sampling, PresenceAndFrequencyPenaltiesCountGeneratedTokensAsOpenAiSays) {
  uint64_t counter = 0;
  auto next = [&](uint32_t n) { return Philox4x32_10(7, counter++, 0).v[0] % n; };
  SamplingScratch scratch;  // shared by every case: its counts must come back to zero
  int changed = 0;
  for (int c = 0; c < 200; ++c) {
    const int vocab = 40;
    std::vector<float> logits(vocab);
    for (float& l : logits) l = static_cast<float>(next(1000)) / 250.0f - 2.0f;
    std::vector<int32_t> history;
    const size_t prompt = next(10), generated = next(30);
    for (size_t i = 0; i < prompt + generated; ++i) history.push_back(next(12));  // repeats
    SamplingParams p;
    p.presence_penalty = static_cast<float>(next(9)) / 2.0f - 2.0f;   // [-2, 2]
    p.frequency_penalty = static_cast<float>(next(9)) / 2.0f - 2.0f;  // [-2, 2]
    ASSERT_TRUE(p.Validate().ok());
    const std::vector<int32_t> output(history.begin() + prompt, history.end());
    const std::vector<float> want =
        PenalizedByOpenAisFormula(logits, output, p.presence_penalty, p.frequency_penalty);
    const uint64_t position = history.size();
    // Sampled: the same draw as from the penalized logits without penalties.
    SamplingParams plain = p;
    plain.presence_penalty = plain.frequency_penalty = 0.0f;
    p.seed = plain.seed = c;
    std::vector<float> got_logits = logits;
    const int32_t got = SampleToken(got_logits, p, history, output, position, scratch);
    std::vector<float> want_logits = want;
    EXPECT_EQ(got, SampleToken(want_logits, plain, history, output, position, scratch)) << c;
    for (int i = 0; i < vocab; ++i) EXPECT_FLOAT_EQ(got_logits[i], want[i]) << c << " " << i;
    // Greedy: the penalized argmax.
    p.temperature = 0.0f;
    std::vector<float> greedy = logits;
    const int32_t g = SampleToken(greedy, p, history, output, position, scratch);
    EXPECT_EQ(g, std::max_element(want.begin(), want.end()) - want.begin()) << c;
    changed += g != std::max_element(logits.begin(), logits.end()) - logits.begin();
  }
  EXPECT_GT(changed, 20);  // the penalties decided many of the cases
  for (int32_t n : scratch.counts) ASSERT_EQ(n, 0);

  // The prompt's tokens are not counted: token 0 only in the prompt keeps its lead.
  SamplingParams p;
  p.temperature = 0.0f;
  p.presence_penalty = 2.0f;
  p.frequency_penalty = 2.0f;
  EXPECT_EQ(Sample({3.0f, 2.0f, 0.0f}, p, 0, {0, 0, 0}, /*prompt_tokens=*/3), 0);
  EXPECT_EQ(Sample({3.0f, 2.0f, 0.0f}, p, 0, {0, 0, 0}, /*prompt_tokens=*/2), 1);  // 3 - 4 < 2
  // Negative penalties favour what was generated.
  p.presence_penalty = -1.5f;
  p.frequency_penalty = 0.0f;
  EXPECT_EQ(Sample({3.0f, 2.0f, 0.0f}, p, 0, {1}, /*prompt_tokens=*/0), 1);
}

TEST(Sampling, ValidateNamesTheBadField) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_NE(p.Validate().message().find("top_p"), std::string::npos);
  p = {};
  p.temperature = -1.0f;
  EXPECT_NE(p.Validate().message().find("temperature"), std::string::npos);
  p = {};
  p.repetition_penalty = 0.0f;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.top_k = -3;
  EXPECT_FALSE(p.Validate().ok());
  p = {};
  p.presence_penalty = 2.5f;
  EXPECT_NE(p.Validate().message().find("presence_penalty"), std::string::npos);
  p = {};
  p.frequency_penalty = -2.0f;
  EXPECT_TRUE(p.Validate().ok());
  p.frequency_penalty = NAN;
  EXPECT_NE(p.Validate().message().find("frequency_penalty"), std::string::npos);
  EXPECT_TRUE(SamplingParams{}.Validate().ok());
}

}  // namespace
}  // namespace infinigen

namespace infinigen {
namespace {

// Log-probabilities against a plainly written double-precision log-softmax and a full sort:
// the chosen token's, and the top n in order, ties to the lower id; large logits do not
// overflow.
TEST(Logprobs, MatchADoubleLogSoftmaxAndItsOrder) {
  std::vector<float> logits(1000);
  uint64_t state = 12345;
  for (float& l : logits) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    l = static_cast<float>(static_cast<int64_t>(state >> 40) % 2000) / 100.0f + 50.0f;
  }
  logits[17] = logits[400] = 80.0f;  // a tie for the best
  double sum = 0.0, mx = -1e300;
  for (float l : logits) mx = std::max(mx, static_cast<double>(l));
  for (float l : logits) sum += std::exp(static_cast<double>(l) - mx);
  auto reference = [&](int32_t id) { return static_cast<double>(logits[id]) - mx - std::log(sum); };
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  TokenLogprobs got;
  ComputeLogprobs(logits, 321, 5, got);
  EXPECT_NEAR(got.logprob, reference(321), 1e-5);
  ASSERT_EQ(got.top.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(got.top[i].first, order[i]) << i;
    EXPECT_NEAR(got.top[i].second, reference(order[i]), 1e-5) << i;
  }
  EXPECT_EQ(got.top[0].first, 17);
  EXPECT_EQ(got.top[1].first, 400);
  // The rank: the token's place in the stable order (ties: lower id first).
  const int64_t place = std::find(order.begin(), order.end(), 321) - order.begin();
  EXPECT_EQ(got.rank, place + 1);
  ComputeLogprobs(logits, 17, 0, got);
  EXPECT_TRUE(got.top.empty());
  EXPECT_NEAR(got.logprob, reference(17), 1e-5);
  EXPECT_EQ(got.rank, 1);
  ComputeLogprobs(logits, 400, 0, got);
  EXPECT_EQ(got.rank, 2);  // tied with 17, a higher id
}

}  // namespace
}  // namespace infinigen
