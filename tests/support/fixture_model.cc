#include "tests/support/fixture_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>

#include "gpu_worker/engine/generator.h"
#include "gpu_worker/engine/resident_kv_cache.h"

namespace infinigen::testing {

LoadedModel LoadModel(const std::string& dir) {
  LoadedModel l;
  auto ckpt = Checkpoint::Open(dir);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status();
  if (!ckpt.ok()) return l;
  l.ckpt = std::move(*ckpt);
  l.backend = std::make_unique<CpuBackend>();
  auto model = Model::Load(*l.ckpt, *l.backend);
  EXPECT_TRUE(model.ok()) << model.status();
  if (model.ok()) l.model = std::move(*model);
  return l;
}

std::vector<float> ChunkedLogits(Model& model, const std::vector<int32_t>& tokens, int64_t chunk) {
  ResidentKvCache cache(model.backend(), model.kv_shape());
  EXPECT_TRUE(cache.Open(7, static_cast<int64_t>(tokens.size())).ok());
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> logits(tokens.size() * vocab);
  for (size_t pos = 0; pos < tokens.size(); pos += chunk) {
    const size_t len = std::min<size_t>(chunk, tokens.size() - pos);
    ForwardChunk c{7, static_cast<int64_t>(pos), std::span(tokens).subspan(pos, len), true};
    auto st = model.Forward({&c, 1}, cache, std::span(logits).subspan(pos * vocab, len * vocab));
    EXPECT_TRUE(st.ok()) << st;
  }
  return logits;
}

std::vector<int32_t> GreedyTokens(Model& model, const std::vector<int32_t>& prompt,
                                  int64_t max_new_tokens) {
  ResidentKvCache cache(model.backend(), model.kv_shape());
  GenerateOptions options;
  options.sampling.temperature = 0.0f;
  options.max_new_tokens = max_new_tokens;
  options.ignore_eos = true;
  auto result = Generate(model, cache, 1, prompt, options);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? result->tokens : std::vector<int32_t>{};
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

}  // namespace infinigen::testing
