#include <gtest/gtest.h>

#include <cmath>

#include "gpu_worker/model/config.h"

namespace infinigen {
namespace {

TEST(RopeFrequencies, DefaultAndLinear) {
  RopeConfig rope;
  rope.theta = 10000.0;
  rope.rotary_dim = 64;
  auto inv = RopeInverseFrequencies(rope);
  ASSERT_EQ(inv.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    EXPECT_NEAR(inv[i], std::pow(10000.0, -2.0 * i / 64), 1e-6 * std::pow(10000.0, -2.0 * i / 64));
  }
  rope.scaling = RopeScaling::kLinear;
  rope.factor = 4.0;
  auto lin = RopeInverseFrequencies(rope);
  for (int i = 0; i < 32; ++i) EXPECT_FLOAT_EQ(lin[i], inv[i] / 4.0f);
}

TEST(RopeFrequencies, Llama3ScalingOfLlama31_8B) {
  // Llama 3.1 8B: head_dim 128, theta 500000, factor 8, low 1, high 4, original context 8192.
  RopeConfig rope;
  rope.theta = 500000.0;
  rope.rotary_dim = 128;
  rope.scaling = RopeScaling::kLlama3;
  rope.factor = 8.0;
  rope.low_freq_factor = 1.0;
  rope.high_freq_factor = 4.0;
  rope.original_max_position_embeddings = 8192;
  auto inv = RopeInverseFrequencies(rope);
  for (int i = 0; i < 64; ++i) {
    const double f = std::pow(500000.0, -2.0 * i / 128);
    const double wavelen = 2 * M_PI / f;
    double want;
    if (wavelen < 8192.0 / 4.0) {
      want = f;  // high frequency: unchanged
    } else if (wavelen > 8192.0 / 1.0) {
      want = f / 8.0;  // low frequency: divided by the factor
    } else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - smooth) * f / 8.0 + smooth * f;
    }
    EXPECT_NEAR(inv[i], want, 2e-6 * want) << i;
  }
}

TEST(HfConfig, ParsesLlamaFieldsAndRejectsWhatItCannotRun) {
  auto c = ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "head_dim": 6, "eos_token_id": [3, 4], "bos_token_id": 1,
      "tie_word_embeddings": true, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})",
                         "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 6);
  EXPECT_EQ(c->q_dim(), 12);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope.scaling, RopeScaling::kLinear);

  auto yarn = ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})",
                            "x/config.json");
  EXPECT_EQ(yarn.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(yarn.status().message().find("yarn"), std::string::npos);

  auto missing = ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10})", "y/config.json");
  EXPECT_NE(missing.status().message().find("hidden_size"), std::string::npos);

  auto gqa = ParseHfConfig(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 12,
      "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 3,
      "num_key_value_heads": 2})",
                           "z/config.json");
  EXPECT_NE(gqa.status().message().find("num_kv_heads"), std::string::npos);
}

TEST(HfConfig, ParsesOptVariants) {
  auto c = ParseHfConfig(R"({"model_type": "opt", "vocab_size": 50, "hidden_size": 16,
      "ffn_dim": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "max_position_embeddings": 64, "do_layer_norm_before": false, "word_embed_proj_dim": 8})",
                         "opt/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kOpt);
  EXPECT_FALSE(c->pre_norm);
  EXPECT_FALSE(c->final_norm);
  EXPECT_TRUE(c->has_projections());
  EXPECT_EQ(c->head_dim, 4);
}

}  // namespace
}  // namespace infinigen
