// The engine against Hugging Face transformers on tiny random checkpoints written by
// scripts/fixtures/make_hf_fixtures.py: logits of a fixed sequence (max |diff| <= 1e-4 in fp32),
// prefill = chunked prefill = token-by-token decode, ragged batches = sequences alone, and the
// 32-token greedy continuation identical to transformers' generate().
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "common/npy.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::FixturePath;

using Loaded = testing::LoadedModel;
using testing::LoadModel;

using testing::ChunkedLogits;
using testing::MaxAbsDiff;

class HfFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(HfFixture, LogitsMatchTransformers) {
  const std::string dir = FixturePath("hf/" + GetParam());
  Loaded l = LoadModel(dir);
  ASSERT_NE(l.model, nullptr);
  auto tokens = testing::NpyInts(dir + "/tokens.npy");
  auto want = testing::NpyFloats(dir + "/logits.npy");
  auto got = ChunkedLogits(*l.model, tokens, static_cast<int64_t>(tokens.size()));
  EXPECT_LE(MaxAbsDiff(got, want), 1e-4f);
}

INSTANTIATE_TEST_SUITE_P(AllFixtures, HfFixture,
                         ::testing::Values("llama2_mha", "llama31_gqa", "llama31_gqa_bf16",
                                           "llama31_gqa_f16", "llama32_tied", "opt_preln",
                                           "opt_preln_bf16", "opt_preln_f16", "opt_proj_postln"));

class HfGeneration : public ::testing::TestWithParam<std::string> {};

TEST_P(HfGeneration, PrefillChunkedPrefillAndDecodeAgree) {
  const std::string dir = FixturePath("hf/" + GetParam());
  Loaded l = LoadModel(dir);
  ASSERT_NE(l.model, nullptr);
  auto tokens = testing::NpyInts(dir + "/tokens.npy");
  auto full = ChunkedLogits(*l.model, tokens, static_cast<int64_t>(tokens.size()));
  EXPECT_LE(MaxAbsDiff(ChunkedLogits(*l.model, tokens, 5), full), 2e-5f);
  EXPECT_LE(MaxAbsDiff(ChunkedLogits(*l.model, tokens, 1), full), 2e-5f);
}

TEST_P(HfGeneration, RaggedBatchEqualsSequencesAlone) {
  const std::string dir = FixturePath("hf/" + GetParam());
  Loaded l = LoadModel(dir);
  ASSERT_NE(l.model, nullptr);
  Model& model = *l.model;
  auto tokens = testing::NpyInts(dir + "/tokens.npy");
  auto alone = ChunkedLogits(model, tokens, static_cast<int64_t>(tokens.size()));
  const int64_t vocab = model.config().vocab_size;

  // Sequence A prefills 10 tokens then decodes one at a time; B prefills 6 tokens in the same
  // steps, then decodes too: prefill and decode chunks mixed in one batch.
  BackendKvCache cache(model.backend(), model.kv_shape());
  ASSERT_TRUE(cache.Open(1, 24).ok());
  ASSERT_TRUE(cache.Open(2, 24).ok());
  std::vector<int32_t> b_tokens(tokens.rbegin(), tokens.rend());
  auto b_alone = ChunkedLogits(model, b_tokens, static_cast<int64_t>(b_tokens.size()));
  std::span<const int32_t> a(tokens), b(b_tokens);
  std::vector<float> logits(2 * 10 * vocab);
  ForwardChunk step0[] = {{1, 0, a.subspan(0, 10), false}, {2, 0, b.subspan(0, 6), true}};
  ASSERT_TRUE(DecodeStep(model, cache).Forward(step0, logits).ok());
  EXPECT_LE(MaxAbsDiff({logits.begin(), logits.begin() + vocab},
                       {alone.begin() + 9 * vocab, alone.begin() + 10 * vocab}),
            2e-5f);
  EXPECT_LE(MaxAbsDiff({logits.begin() + vocab, logits.begin() + 7 * vocab},
                       {b_alone.begin(), b_alone.begin() + 6 * vocab}),
            2e-5f);
  for (int64_t step = 0; step < 8; ++step) {
    ForwardChunk s[] = {{1, 10 + step, a.subspan(10 + step, 1), false},
                        {2, 6 + step, b.subspan(6 + step, 1), false}};
    ASSERT_TRUE(DecodeStep(model, cache).Forward(s, logits).ok());
    EXPECT_LE(
        MaxAbsDiff({logits.begin(), logits.begin() + vocab},
                   {alone.begin() + (10 + step) * vocab, alone.begin() + (11 + step) * vocab}),
        2e-5f);
    EXPECT_LE(
        MaxAbsDiff({logits.begin() + vocab, logits.begin() + 2 * vocab},
                   {b_alone.begin() + (6 + step) * vocab, b_alone.begin() + (7 + step) * vocab}),
        2e-5f);
  }
}

TEST_P(HfGeneration, GreedyTokensMatchTransformersGenerate) {
  const std::string dir = FixturePath("hf/" + GetParam());
  Loaded l = LoadModel(dir);
  ASSERT_NE(l.model, nullptr);
  auto prompt = testing::NpyInts(dir + "/prompt.npy");
  auto want = testing::NpyInts(dir + "/greedy.npy");
  EXPECT_EQ(testing::GreedyTokens(*l.model, prompt, static_cast<int64_t>(want.size())), want);
}

INSTANTIATE_TEST_SUITE_P(AllModels, HfGeneration,
                         ::testing::Values("llama2_mha", "llama31_gqa", "llama32_tied", "opt_preln",
                                           "opt_proj_postln"));

TEST(HfFixtureErrors, TokenIdOutsideVocabularyIsInvalidArgument) {
  Loaded l = LoadModel(FixturePath("hf/llama31_gqa"));
  ASSERT_NE(l.model, nullptr);
  BackendKvCache cache(l.model->backend(), l.model->kv_shape());
  ASSERT_TRUE(cache.Open(1, 4).ok());
  std::vector<int32_t> bad = {1, 211};
  std::vector<float> logits(l.model->config().vocab_size);
  ForwardChunk c{1, 0, bad, false};
  auto st = DecodeStep(*l.model, cache).Forward({&c, 1}, logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("211"), std::string::npos) << st;
}

TEST(HfFixtureErrors, OptPositionsPastTheTableAreInvalidArgument) {
  Loaded l = LoadModel(FixturePath("hf/opt_preln"));
  ASSERT_NE(l.model, nullptr);
  BackendKvCache cache(l.model->backend(), l.model->kv_shape());
  GenerateOptions options;
  options.max_new_tokens = 200;  // 8 + 200 > 128 learned positions
  std::vector<int32_t> prompt(8, 3);
  auto result = Generate(*l.model, cache, 1, prompt, options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace infinigen
