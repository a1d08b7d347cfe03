#include "tests/support/fixture_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>

#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/kv/backend_kv_cache.h"

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
  BackendKvCache cache(model.backend(), model.kv_shape());
  EXPECT_TRUE(cache.Open(7, static_cast<int64_t>(tokens.size())).ok());
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> logits(tokens.size() * vocab);
  for (size_t pos = 0; pos < tokens.size(); pos += chunk) {
    const size_t len = std::min<size_t>(chunk, tokens.size() - pos);
    ForwardChunk c{7, static_cast<int64_t>(pos), std::span(tokens).subspan(pos, len), true};
    auto st = DecodeStep(model, cache)
                  .Forward({&c, 1}, std::span(logits).subspan(pos * vocab, len * vocab));
    EXPECT_TRUE(st.ok()) << st;
  }
  return logits;
}

std::vector<int32_t> GreedyTokens(Model& model, const std::vector<int32_t>& prompt,
                                  int64_t max_new_tokens) {
  BackendKvCache cache(model.backend(), model.kv_shape());
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

DecodeRun Decode(Model& model, KvCache& cache, std::vector<KvSelectionPolicy*> policies,
                 const std::vector<std::vector<int32_t>>& prompts, int64_t steps, int64_t chunk,
                 int64_t capacity) {
  const int64_t vocab = model.config().vocab_size;
  const size_t n = prompts.size();
  DecodeRun run;
  run.tokens.resize(n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(cache.Open(i + 1, capacity).ok());
    if (policies[i] != nullptr) policies[i]->Open(i + 1, capacity);
  }
  std::vector<float> logits(n * vocab);
  std::vector<int32_t> next(n);
  DecodeStep step(model, cache);
  if (chunk >= 1000) {  // every whole prompt in one forward pass
    std::vector<ForwardChunk> batch;
    for (size_t i = 0; i < n; ++i) batch.push_back({i + 1, 0, prompts[i], false, policies[i]});
    auto st = step.Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st;
  }
  for (size_t i = 0; i < n && chunk < 1000; ++i) {  // prefill one sequence at a time, in chunks
    for (int64_t pos = 0; pos < static_cast<int64_t>(prompts[i].size()); pos += chunk) {
      const int64_t len = std::min<int64_t>(chunk, prompts[i].size() - pos);
      ForwardChunk c{i + 1, pos, std::span<const int32_t>(prompts[i]).subspan(pos, len), false,
                     policies[i]};
      auto st = step.Forward({&c, 1}, std::span<float>(logits).subspan(i * vocab, vocab));
      EXPECT_TRUE(st.ok()) << st;
    }
  }
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<ForwardChunk> batch;
    for (size_t i = 0; i < n; ++i) {
      const float* row = logits.data() + i * vocab;
      next[i] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      run.tokens[i].push_back(next[i]);
      batch.push_back({i + 1, static_cast<int64_t>(prompts[i].size()) + s,
                       std::span<const int32_t>(&next[i], 1), false, policies[i]});
    }
    auto st = step.Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    run.logits.insert(run.logits.end(), logits.begin(), logits.end());
  }
  for (size_t i = 0; i < n; ++i) {
    run.bytes_fetched += cache.Counters(i + 1).bytes_fetched;
    run.bytes_reused += cache.Counters(i + 1).bytes_reused;
    cache.Close(i + 1);
    if (policies[i] != nullptr) policies[i]->Release(i + 1);
  }
  run.prefetch_hits = step.prefetch_hits();
  run.profile = step.profile();
  run.prefetch_misses = step.prefetch_misses();
  return run;
}

MixedRun Mixed(Model& model, KvCache& cache, std::vector<KvSelectionPolicy*> policies,
               const std::vector<std::vector<int32_t>>& prompts, int64_t steps) {
  const int64_t vocab = model.config().vocab_size, chunk = 8;
  MixedRun run;
  run.tokens.resize(3);
  for (SequenceId seq = 1; seq <= 3; ++seq) {
    EXPECT_TRUE(cache.Open(seq, 256).ok());
    policies[seq - 1]->Open(seq, 256);
  }
  DecodeStep step(model, cache);
  std::vector<float> logits(3 * vocab);
  std::vector<int64_t> length(3, 0);  // tokens in the cache
  std::vector<int32_t> next(3);
  for (size_t i = 0; i < 2; ++i) {
    const ForwardChunk c{i + 1, 0, prompts[i], false, policies[i]};
    EXPECT_TRUE(step.Forward({&c, 1}, std::span<float>(logits).subspan(i * vocab, vocab)).ok());
    length[i] = static_cast<int64_t>(prompts[i].size());
  }
  std::vector<const float*> last(3, nullptr);  // each sequence's latest logits
  last[0] = logits.data();
  last[1] = logits.data() + vocab;
  std::vector<float> kept(3 * vocab);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<ForwardChunk> batch;
    std::vector<size_t> of;  // the sequence (index) of each chunk
    for (size_t i = 0; i < 3; ++i) {
      const int64_t prompt = static_cast<int64_t>(prompts[i].size());
      if (length[i] < prompt) {  // a prompt chunk
        const int64_t len = std::min(chunk, prompt - length[i]);
        batch.push_back({i + 1, length[i],
                         std::span<const int32_t>(prompts[i]).subspan(length[i], len), false,
                         policies[i]});
        length[i] += len;
      } else {
        next[i] = static_cast<int32_t>(std::max_element(last[i], last[i] + vocab) - last[i]);
        run.tokens[i].push_back(next[i]);
        batch.push_back(
            {i + 1, length[i], std::span<const int32_t>(&next[i], 1), false, policies[i]});
        length[i] += 1;
      }
      of.push_back(i);
    }
    const int64_t waits = model.backend().counters().synchronizations;
    const absl::Status st =
        step.Forward(batch, std::span<float>(logits).first(batch.size() * vocab));
    EXPECT_TRUE(st.ok()) << "step " << s << ": " << st;
    if (!st.ok()) break;
    run.waits.push_back(model.backend().counters().synchronizations - waits);
    run.mixed.push_back(std::any_of(batch.begin(), batch.end(),
                                    [](const ForwardChunk& c) { return c.tokens.size() > 1; }));
    std::copy(logits.begin(), logits.begin() + batch.size() * vocab, kept.begin());
    for (size_t j = 0; j < batch.size(); ++j) last[of[j]] = kept.data() + j * vocab;
    run.logits.insert(run.logits.end(), logits.begin(), logits.begin() + batch.size() * vocab);
  }
  for (SequenceId seq = 1; seq <= 3; ++seq) {
    run.bytes_fetched += cache.Counters(seq).bytes_fetched;
    run.bytes_reused += cache.Counters(seq).bytes_reused;
    cache.Close(seq);
    policies[seq - 1]->Release(seq);
  }
  return run;
}

}  // namespace infinigen::testing
