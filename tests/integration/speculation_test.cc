// The speculation weights (gpu_worker/model/speculation.h) on the tiny Hugging Face fixtures:
// whichever form a sidecar allows (W_q with A folded in for OPT, W_q's rows of whole RoPE pairs,
// or the Q projection then A), the partial query equals a plainly written double-precision
// reference q~_h = RoPE(W_q x + b)_h . A_g[:, P], and the two partial forms cost at most half of
// the layer's Q/K/V projection. Sidecars made of RoPE pairs round-trip and are checked on load.
#include "gpu_worker/model/speculation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "absl/strings/str_cat.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::LoadedModel;
using testing::LoadModel;

InfinigenSidecar Prepare(LoadedModel& l, bool skew, bool rope_pairs) {
  PrepareOptions options;
  options.ratio = 0.5f;
  options.chunk_tokens = 40;
  options.skew = skew;
  options.rope_pairs = rope_pairs;
  auto s = PrepareInfinigen(*l.model, *l.ckpt,
                            testing::RandomTokens(96, l.model->config().vocab_size, 5), options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : InfinigenSidecar{};
}

// q~ of `layer` for input rows x [rows, hidden] at `positions`, in double from the checkpoint.
std::vector<double> Reference(const Checkpoint& ckpt, const InfinigenSidecar& s, int layer,
                              const std::vector<float>& x, const std::vector<int32_t>& positions) {
  const ModelConfig& c = ckpt.config();
  const bool llama = c.architecture == Architecture::kLlama;
  const std::string name =
      absl::StrCat(llama ? "model.layers." : "model.decoder.layers.", layer, ".self_attn.q_proj.");
  const std::vector<float> w = ckpt.ReadFloat(name + "weight", {c.q_dim(), c.hidden_size}).value();
  std::vector<float> b(c.q_dim(), 0.0f);
  if (c.attention_bias) b = ckpt.ReadFloat(name + "bias", {c.q_dim()}).value();
  const std::vector<float> inv_freq = RopeInverseFrequencies(c.rope);
  const std::vector<float> a = s.PartialSkew(layer);
  const int64_t d = c.head_dim, p = s.partial_dim, group = c.num_heads / c.num_kv_heads;
  const int64_t rows = static_cast<int64_t>(positions.size());
  std::vector<double> out(rows * c.num_heads * p);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> q(c.q_dim());
    for (int64_t o = 0; o < c.q_dim(); ++o) {
      double sum = b[o];
      for (int64_t i = 0; i < c.hidden_size; ++i)
        sum += double(w[o * c.hidden_size + i]) * x[r * c.hidden_size + i];
      q[o] = sum;
    }
    for (int64_t h = 0; h < c.num_heads && llama; ++h) {
      double* head = q.data() + h * d;
      const int half = c.rope.rotary_dim / 2;
      for (int i = 0; i < half; ++i) {
        const double angle = static_cast<float>(positions[r]) * inv_freq[i];  // f32, as HF
        const bool inter = c.rope.layout == cpu::RopeLayout::kInterleaved;
        double& x0 = head[inter ? 2 * i : i];
        double& x1 = head[inter ? 2 * i + 1 : i + half];
        const double a0 = x0, a1 = x1;
        x0 = a0 * std::cos(angle) - a1 * std::sin(angle);
        x1 = a1 * std::cos(angle) + a0 * std::sin(angle);
      }
    }
    for (int64_t h = 0; h < c.num_heads; ++h) {
      for (int64_t col = 0; col < p; ++col) {
        double sum = 0;
        for (int64_t i = 0; i < d; ++i) sum += q[h * d + i] * a[((h / group) * d + i) * p + col];
        out[(r * c.num_heads + h) * p + col] = sum;
      }
    }
  }
  return out;
}

struct Case {
  std::string fixture;
  bool skew, rope_pairs;
  Speculation::Mode mode;  // unskewed free channels may happen to be whole pairs: either mode
};

class SpeculationForms : public ::testing::TestWithParam<Case> {};

TEST_P(SpeculationForms, PartialQueryEqualsTheDoubleReference) {
  const Case& tc = GetParam();
  LoadedModel l = LoadModel(testing::FixturePath("hf/" + tc.fixture));
  ASSERT_NE(l.model, nullptr);
  const InfinigenSidecar s = Prepare(l, tc.skew, tc.rope_pairs);
  ASSERT_TRUE(AttachSidecar(*l.model, *l.ckpt, s).ok());
  const Speculation* spec = l.model->speculation();
  ASSERT_NE(spec, nullptr);
  if (tc.skew || tc.rope_pairs) {
    EXPECT_EQ(spec->mode(), tc.mode);
  }
  EXPECT_EQ(spec->partial_dim(), s.partial_dim);
  if (tc.mode != Speculation::Mode::kFullQuery) {
    EXPECT_LE(2 * spec->MacsPerToken(), spec->QkvMacsPerToken())
        << spec->MacsPerToken() << " multiply-adds against " << spec->QkvMacsPerToken();
  }
  const ModelConfig& c = l.model->config();
  const int64_t rows = 3, cols = c.num_heads * s.partial_dim;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(rows * c.hidden_size), scratch(rows * c.q_dim()), out(rows * cols);
  for (float& v : x) v = normal(rng);
  std::vector<int32_t> positions = {0, 17, 200};
  for (int layer = 0; layer < c.num_layers; ++layer) {
    ASSERT_TRUE(l.model
                    ->SpeculatePartialQuery(
                        layer, {x.data(), DType::kF32, rows, c.hidden_size, c.hidden_size},
                        positions.data(), {scratch.data(), DType::kF32, rows, c.q_dim(), c.q_dim()},
                        {out.data(), DType::kF32, rows, cols, cols})
                    .ok());
    const std::vector<double> want = Reference(*l.ckpt, s, layer, x, positions);
    double scale = 0;
    for (double v : want) scale = std::max(scale, std::abs(v));
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(out[i], want[i], 1e-5 * scale + 1e-6) << "layer " << layer << " value " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TinyModels, SpeculationForms,
    ::testing::Values(Case{"llama31_gqa", true, false, Speculation::Mode::kFullQuery},
                      Case{"llama31_gqa", false, false, Speculation::Mode::kFullQuery},
                      Case{"llama31_gqa", false, true, Speculation::Mode::kRopePairs},
                      Case{"llama2_mha", false, true, Speculation::Mode::kRopePairs},
                      Case{"llama32_tied", false, true, Speculation::Mode::kRopePairs},
                      Case{"opt_preln", true, false, Speculation::Mode::kFoldedQuery},
                      Case{"opt_proj_postln", true, false, Speculation::Mode::kFoldedQuery}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return info.param.fixture + (info.param.rope_pairs ? "_pairs"
                                   : info.param.skew     ? "_skewed"
                                                         : "_unskewed");
    });

// Unskewed channels that are pairs in the wrong order (a partner first), or a sidecar that says
// it is unskewed while its A is not a pick of channels, are not computed as RoPE pairs (that
// would rotate by the opposite angle or miss A): the speculation falls back to Q then A, and
// its partial query still equals the double reference.
TEST(RopePairSidecar, PairsOnlyWhenTheyAreExactlyPairsInOrder) {
  LoadedModel l = LoadModel(testing::FixturePath("hf/llama31_gqa"));
  ASSERT_NE(l.model, nullptr);
  const ModelConfig& c = l.model->config();
  InfinigenSidecar swapped = Prepare(l, true, true);
  ASSERT_TRUE(swapped.rope_pairs);
  const int p = swapped.partial_dim, m = p / 2;
  for (auto& layer : swapped.channels) {  // partners first, then the lower channels
    for (int g = 0; g < c.num_kv_heads; ++g) {
      std::rotate(layer.begin() + g * p, layer.begin() + g * p + m, layer.begin() + (g + 1) * p);
    }
  }
  swapped.rope_pairs = false;
  InfinigenSidecar not_a_pick = Prepare(l, true, true);
  not_a_pick.rope_pairs = false;
  for (auto& a : not_a_pick.skew) a[1] = 0.5f;  // still "unskewed", but A is no longer a pick
  for (const InfinigenSidecar* s : {&swapped, &not_a_pick}) {
    ASSERT_TRUE(AttachSidecar(*l.model, *l.ckpt, *s).ok());
    EXPECT_EQ(l.model->speculation()->mode(), Speculation::Mode::kFullQuery);
    const int64_t cols = c.num_heads * p;
    std::vector<float> x(c.hidden_size, 0.25f), scratch(c.q_dim()), out(cols);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.7f * i);
    const std::vector<int32_t> pos = {33};
    ASSERT_TRUE(l.model
                    ->SpeculatePartialQuery(
                        3 % c.num_layers, {x.data(), DType::kF32, 1, c.hidden_size, c.hidden_size},
                        pos.data(), {scratch.data(), DType::kF32, 1, c.q_dim(), c.q_dim()},
                        {out.data(), DType::kF32, 1, cols, cols})
                    .ok());
    const std::vector<double> want = Reference(*l.ckpt, *s, 3 % c.num_layers, x, pos);
    for (int64_t i = 0; i < cols; ++i) ASSERT_NEAR(out[i], want[i], 1e-4) << i;
  }
}

TEST(RopePairSidecar, RoundTripsAndIsCheckedOnLoad) {
  LoadedModel l = LoadModel(testing::FixturePath("hf/llama31_gqa"));
  ASSERT_NE(l.model, nullptr);
  InfinigenSidecar s = Prepare(l, true, true);
  EXPECT_FALSE(s.skewed) << "RoPE pairs are never skewed";
  EXPECT_TRUE(s.rope_pairs);
  EXPECT_EQ(s.partial_dim % 2, 0);
  const ModelConfig& c = l.model->config();
  for (const auto& channels : s.channels) {
    EXPECT_TRUE(IsRopePairOrder(channels, c.num_kv_heads, s.partial_dim, c.head_dim,
                                c.rope.rotary_dim, c.rope.layout));
  }
  const std::string path = ::testing::TempDir() + "/pairs.infinigen.safetensors";
  ASSERT_TRUE(WriteSidecar(s, path).ok());
  auto back = ReadSidecar(path, *l.ckpt);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->rope_pairs);
  EXPECT_EQ(back->channels, s.channels);
  // A sidecar that claims pairs it does not hold is refused.
  std::swap(s.channels[1][0], s.channels[1][1]);
  ASSERT_TRUE(WriteSidecar(s, path).ok());
  auto bad = ReadSidecar(path, *l.ckpt);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bad.status().message().find("not whole RoPE pairs"), std::string::npos) << bad.status();
  // OPT has no RoPE: pairs (the default) give way to the skew there.
  LoadedModel opt = LoadModel(testing::FixturePath("hf/opt_preln"));
  const InfinigenSidecar skewed = Prepare(opt, true, true);
  EXPECT_FALSE(skewed.rope_pairs);
  EXPECT_TRUE(skewed.skewed);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace infinigen
