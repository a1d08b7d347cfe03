// Batch invariance on SmolLM2, every CPU weight format (and q8 with bf16 K/V): 24 sequences arrive
// one step apart, so the steps hold 1 to 24 of them, mixing prompt chunks of varying sizes with
// decode tokens; the logits of every decode step of every sequence are bit for bit those of the
// same sequence run alone (its prompt in one piece, then one token at a time). With the
// batch-dependent OpenBLAS path (--batch-invariant=false) they are not, which is what the test
// would catch.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "gpu_worker/model/model.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

constexpr int kSequences = 24;
constexpr int kNewTokens = 5;

struct Sequence {
  std::vector<int32_t> tokens;  // prompt, then the greedy tokens
  int64_t prompt = 0;
  int64_t done = 0;                       // tokens in the cache
  std::vector<std::vector<float>> steps;  // logits after the prompt and each decode token
};

int32_t Argmax(const float* row, int64_t vocab) {
  return static_cast<int32_t>(std::max_element(row, row + vocab) - row);
}

// Every sequence alone: the prompt in one chunk, then greedy decode.
void RunAlone(Model& model, Sequence& s) {
  const int64_t vocab = model.config().vocab_size;
  BackendKvCache cache(model.backend(), model.kv_shape());
  ASSERT_TRUE(cache.Open(1, s.prompt + kNewTokens).ok());
  DecodeStep step(model, cache);
  std::vector<float> logits(vocab);
  for (int g = 0; g < kNewTokens; ++g) {
    const int64_t len = g == 0 ? s.prompt : 1;
    ForwardChunk c{1, s.done, std::span<const int32_t>(s.tokens).subspan(s.done, len), false};
    ASSERT_TRUE(step.Forward({&c, 1}, logits).ok());
    s.done += len;
    s.steps.push_back(logits);
    s.tokens.push_back(Argmax(logits.data(), vocab));
  }
}

// All sequences together: sequence i joins at step i; each step carries one decode token of
// every sequence past its prompt and prompt chunks of up to `chunk` tokens of the others
// (a different chunk size per sequence), so batches grow to 24 and shrink again.
std::vector<Sequence> RunTogether(Model& model, std::vector<Sequence> seqs) {
  const int64_t vocab = model.config().vocab_size;
  BackendKvCache cache(model.backend(), model.kv_shape());
  DecodeStep step(model, cache);
  std::vector<float> logits;
  for (int t = 0;; ++t) {
    std::vector<ForwardChunk> batch;
    std::vector<size_t> owners;
    for (size_t i = 0; i < seqs.size() && static_cast<int>(i) <= t; ++i) {
      Sequence& s = seqs[i];
      if (static_cast<int>(i) == t) {
        EXPECT_TRUE(cache.Open(i + 1, s.prompt + kNewTokens).ok());
      }
      if (s.done >= s.prompt + kNewTokens - 1) continue;
      const int64_t chunk = 3 + static_cast<int64_t>(i % 5) * 7;  // 3 .. 31 prompt tokens
      const int64_t len = s.done < s.prompt ? std::min(chunk, s.prompt - s.done) : 1;
      batch.push_back(
          {i + 1, s.done, std::span<const int32_t>(s.tokens).subspan(s.done, len), false});
      owners.push_back(i);
    }
    if (batch.empty() && t >= kSequences) break;
    logits.resize(DecodeStep::NumLogitRows(batch) * vocab);
    auto st = step.Forward(batch, logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    for (size_t b = 0; b < batch.size(); ++b) {
      Sequence& s = seqs[owners[b]];
      s.done += static_cast<int64_t>(batch[b].tokens.size());
      if (s.done < s.prompt) continue;  // more prompt to go
      const float* row = logits.data() + b * vocab;
      s.steps.emplace_back(row, row + vocab);
      if (static_cast<int64_t>(s.tokens.size()) == s.done) s.tokens.push_back(Argmax(row, vocab));
    }
  }
  return seqs;
}

struct Storage {
  WeightFormat weights;
  DType kv;  // CpuBackendOptions::kv_dtype
};

class BatchInvariance : public ::testing::TestWithParam<Storage> {};

TEST_P(BatchInvariance, EverySequenceOfMixedStepsEqualsItselfAlone) {
  const std::string path = testing::SmolLm2Path();
  IG_REQUIRE_FILE(path, "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  auto ckpt = Checkpoint::Open(path);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CpuBackendOptions options;
  options.weight_format = GetParam().weights;
  options.kv_dtype = GetParam().kv;
  CpuBackend backend(options);
  auto model = Model::Load(**ckpt, backend);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<Sequence> seqs(kSequences);
  for (int i = 0; i < kSequences; ++i) {
    seqs[i].prompt = 4 + (i * 13) % 41;
    seqs[i].tokens = testing::RandomTokens(seqs[i].prompt, (*model)->config().vocab_size, 100 + i);
  }
  const std::vector<Sequence> together = RunTogether(**model, seqs);
  for (int i = 0; i < kSequences; ++i) {
    Sequence alone = seqs[i];
    RunAlone(**model, alone);
    ASSERT_EQ(together[i].steps.size(), alone.steps.size()) << "sequence " << i;
    EXPECT_EQ(together[i].tokens, alone.tokens) << "sequence " << i;
    for (size_t s = 0; s < alone.steps.size(); ++s) {
      EXPECT_EQ(together[i].steps[s], alone.steps[s])
          << "sequence " << i << ", step " << s << ": logits differ from the sequence alone";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CpuFormats, BatchInvariance,
                         ::testing::Values(Storage{WeightFormat::kF32, DType::kF32},
                                           Storage{WeightFormat::kBF16, DType::kF32},
                                           Storage{WeightFormat::kQ8, DType::kF32},
                                           Storage{WeightFormat::kQ8, DType::kBF16},
                                           Storage{WeightFormat::kQ4_1, DType::kBF16}),
                         [](const ::testing::TestParamInfo<Storage>& info) {
                           return std::string(WeightFormatName(info.param.weights)) + "_kv_" +
                                  std::string(DTypeName(info.param.kv));
                         });

}  // namespace
}  // namespace infinigen
