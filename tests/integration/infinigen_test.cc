// InfiniGen end to end on the tiny Hugging Face fixtures: prepare writes a sidecar that reads
// back (and refuses other models), every policy generates, `full` is dense attention exactly,
// InfiniGen with a 100% budget and an unbounded margin equals `full`, the OPT model with the
// skew folded into W_q and W_k keeps its logits, and the KV pool never brings back an evicted
// token while the policy's partial key cache stays slot-aligned with it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/engine/generator.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/kv_pool_cache.h"
#include "gpu_worker/model/safetensors.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

using Loaded = testing::LoadedModel;
using testing::LoadModel;

using testing::RandomTokens;

InfinigenSidecar Prepare(Loaded& l, float ratio = 0.5f) {
  auto tokens = RandomTokens(96, l.model->config().vocab_size, 5);
  PrepareOptions options;
  options.ratio = ratio;
  options.chunk_tokens = 40;
  auto s = PrepareInfinigen(*l.model, *l.ckpt, tokens, options);
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) {
    EXPECT_TRUE(AttachSidecar(*l.model, *l.ckpt, *s).ok());
  }
  return *s;
}

// Greedy tokens and the logits of every generated step, with `policy` (null = dense).
struct DecodeRun {
  std::vector<int32_t> tokens;
  std::vector<float> logits;  // [steps, vocab]
};

DecodeRun Decode(Model& model, KvCache& cache, KvSelectionPolicy* policy, int64_t prompt_len,
                 int64_t steps) {
  DecodeRun run;
  const int64_t vocab = model.config().vocab_size;
  auto prompt = RandomTokens(prompt_len, vocab, 9);
  EXPECT_TRUE(cache.Open(1, prompt_len + steps).ok());
  std::vector<float> logits(vocab);
  ForwardChunk first{1, 0, prompt, false, policy};
  EXPECT_TRUE(DecodeStep(model, cache).Forward({&first, 1}, logits).ok());
  int32_t next = 0;
  for (int64_t s = 0; s < steps; ++s) {
    next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    run.tokens.push_back(next);
    ForwardChunk c{1, prompt_len + s, std::span<const int32_t>(&next, 1), false, policy};
    auto st = DecodeStep(model, cache).Forward({&c, 1}, logits);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) break;
    run.logits.insert(run.logits.end(), logits.begin(), logits.end());
  }
  cache.Close(1);
  if (policy != nullptr) policy->Release(1);
  return run;
}

class Fixture : public ::testing::TestWithParam<std::string> {};

TEST_P(Fixture, SidecarRoundTripsAndRefusesOtherModels) {
  Loaded l = LoadModel(testing::FixturePath("hf/" + GetParam()));
  InfinigenSidecar s = Prepare(l);
  const std::string path = ::testing::TempDir() + "/" + GetParam() + ".infinigen.safetensors";
  ASSERT_TRUE(WriteSidecar(s, path).ok());
  auto back = ReadSidecar(path, *l.ckpt);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->partial_dim, s.partial_dim);
  EXPECT_EQ(back->skew, s.skew);
  EXPECT_EQ(back->channels, s.channels);
  EXPECT_EQ(back->calibration_hash, s.calibration_hash);
  EXPECT_EQ(back->channel_rule, "product");  // the default
  EXPECT_EQ(back->skewed, s.skewed);
  // Another model's checkpoint: a clear refusal.
  Loaded other = LoadModel(
      testing::FixturePath(GetParam() == "llama32_tied" ? "hf/llama2_mha" : "hf/llama32_tied"));
  auto wrong = ReadSidecar(path, *other.ckpt);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(wrong.status().message().find("another model"), std::string::npos) << wrong.status();
  fs::remove(path);
}

TEST_P(Fixture, EveryPolicyGeneratesAndFullIsDense) {
  Loaded l = LoadModel(testing::FixturePath("hf/" + GetParam()));
  InfinigenSidecar sidecar = Prepare(l);
  BackendKvCache cache(*l.backend, l.model->kv_shape());
  const DecodeRun dense = Decode(*l.model, cache, nullptr, 24, 20);
  for (const char* name : {"full", "infinigen", "h2o", "window", "oracle"}) {
    SelectionConfig config;
    config.policy = ParsePolicyKind(name).value();
    config.dense_layers = 1;  // the fixtures have 2 layers: make layer 1 sparse
    config.budget_fraction = 0.3;
    auto policy = MakeSelectionPolicy(config, l.model->config(), &sidecar);
    ASSERT_TRUE(policy.ok()) << policy.status();
    const DecodeRun run = Decode(*l.model, cache, policy->get(), 24, 20);
    EXPECT_EQ(run.tokens.size(), 20u) << name;
    if (std::string(name) == "full") {
      EXPECT_EQ(run.logits, dense.logits);
    }
  }
  // InfiniGen with a 100% budget and an unbounded margin is dense attention.
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  config.dense_layers = 1;
  config.budget_fraction = 1.0;
  config.alpha = 1e30;
  auto policy = MakeSelectionPolicy(config, l.model->config(), &sidecar);
  ASSERT_TRUE(policy.ok());
  EXPECT_EQ(Decode(*l.model, cache, policy->get(), 24, 20).logits, dense.logits);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, Fixture,
                         ::testing::Values("llama2_mha", "llama31_gqa", "llama32_tied", "opt_preln",
                                           "opt_proj_postln"));

// Folding OPT's skew into the weights: per head, W_q rows and bias rotated by Aᵀ (and the same
// for W_k) leave q·kᵀ, so the logits, unchanged.
TEST(OptFolding, FoldedWeightsKeepTheLogits) {
  const std::string dir = testing::FixturePath("hf/opt_preln");
  Loaded l = LoadModel(dir);
  InfinigenSidecar s = Prepare(l, 0.25f);
  const ModelConfig& c = l.model->config();
  const std::string out = ::testing::TempDir() + "/opt_folded";
  fs::create_directories(out);
  fs::copy_file(dir + "/config.json", out + "/config.json", fs::copy_options::overwrite_existing);
  std::vector<SafetensorsEntry> tensors;
  const int64_t d = c.head_dim;
  for (const std::string& name : l.ckpt->TensorNames()) {
    const StoredTensor* t = l.ckpt->Find(name);
    std::vector<float> values(t->NumElements());
    DecodeToFloat(*t, values.data());
    const bool q = name.find("q_proj") != std::string::npos;
    const bool k = name.find("k_proj") != std::string::npos;
    if (q || k) {
      const int layer = std::stoi(name.substr(name.find("layers.") + 7));
      const bool bias = name.find(".bias") != std::string::npos;
      const int64_t cols = bias ? 1 : c.hidden_size;
      std::vector<float> rotated(values.size(), 0.0f);
      for (int64_t g = 0; g < c.num_kv_heads; ++g) {
        const float* a = s.skew[layer].data() + g * d * d;  // [d, d], columns = directions
        for (int64_t j = 0; j < d; ++j) {                   // new row j = Σ_i A[i, j] · old row i
          for (int64_t i = 0; i < d; ++i) {
            for (int64_t col = 0; col < cols; ++col) {
              rotated[(g * d + j) * cols + col] += a[i * d + j] * values[(g * d + i) * cols + col];
            }
          }
        }
      }
      values = rotated;
    }
    tensors.push_back({name, t->shape, values});
  }
  ASSERT_TRUE(WriteSafetensors(out + "/model.safetensors", tensors, {}).ok());
  Loaded folded = LoadModel(out);
  BackendKvCache cache(*l.backend, l.model->kv_shape());
  BackendKvCache cache2(*folded.backend, folded.model->kv_shape());
  const DecodeRun a = Decode(*l.model, cache, nullptr, 16, 8);
  const DecodeRun b = Decode(*folded.model, cache2, nullptr, 16, 8);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  float max_diff = 0;
  for (size_t i = 0; i < a.logits.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(a.logits[i] - b.logits[i]));
  }
  EXPECT_LE(max_diff, 1e-4f);
  // The rotation did change the weights (a real test of invariance, not of a no-op).
  EXPECT_NE(
      l.ckpt->ReadFloat("model.decoder.layers.0.self_attn.q_proj.weight", {48, 48}).value(),
      folded.ckpt->ReadFloat("model.decoder.layers.0.self_attn.q_proj.weight", {48, 48}).value());
  fs::remove_all(out);
}

// Checks every decode step of a KV-pool run: selected slots hold resident tokens, evicted
// tokens never come back, and the policy saw the same slot positions as the pool.
class PoolObserver final : public KvSelectionPolicy {
 public:
  PoolObserver(std::unique_ptr<KvSelectionPolicy> inner, KvPoolCache& pool, const ModelConfig& c)
      : inner_(std::move(inner)), pool_(pool), c_(c) {}
  std::string Name() const override { return inner_->Name(); }
  SpeculationInput speculation_input() const override { return inner_->speculation_input(); }
  bool wants_attention_weights() const override { return inner_->wants_attention_weights(); }
  absl::Status OnKeys(const LayerKeys& keys) override {
    for (int64_t t = 0; t < keys.count; ++t) {
      for (int g = 0; g < c_.num_kv_heads; ++g) {
        const int32_t slot = keys.slots[t * c_.num_kv_heads + g];
        const auto& pos = pool_.SlotPositions(keys.seq, keys.layer, g);
        if (pos[slot] != keys.start + t) misaligned_++;
      }
    }
    return inner_->OnKeys(keys);
  }
  absl::Status Select(const SelectRequest& r, Selection& out) override {
    auto st = inner_->Select(r, out);
    for (int g = 0; g < c_.num_kv_heads; ++g) {
      const auto& pos = pool_.SlotPositions(r.seq, r.layer, g);
      std::set<int64_t> resident;
      for (int64_t s = 0; s < r.kv.num_slots; ++s) resident.insert(pos[s]);
      auto& seen = evicted_[{r.layer, g}];
      for (int64_t p : last_resident_[{r.layer, g}]) {
        if (!resident.count(p)) seen.insert(p);
      }
      last_resident_[{r.layer, g}] = resident;
      for (int64_t j = 0; !out.all && j < out.count; ++j) {
        const int64_t p = pos[out.indices[g * out.count + j]];
        selected_evicted_ += seen.count(p);
      }
    }
    return st;
  }
  void OnAttentionWeights(SequenceId s, int l, const Selection& sel, const float* w,
                          int64_t rows) override {
    inner_->OnAttentionWeights(s, l, sel, w, rows);
  }
  void Release(SequenceId seq) override { inner_->Release(seq); }

  int64_t misaligned_ = 0, selected_evicted_ = 0;

 private:
  std::unique_ptr<KvSelectionPolicy> inner_;
  KvPoolCache& pool_;
  const ModelConfig& c_;
  std::map<std::pair<int, int>, std::set<int64_t>> evicted_, last_resident_;
};

TEST(KvPool, EvictionNeverReselectsAndKeepsSlotsAligned) {
  Loaded l = LoadModel(testing::FixturePath("hf/llama31_gqa"));
  InfinigenSidecar sidecar = Prepare(l);
  for (EvictionPolicy eviction :
       {EvictionPolicy::kCounter, EvictionPolicy::kFifo, EvictionPolicy::kLru}) {
    for (const char* name : {"infinigen", "h2o", "full"}) {
      KvPoolConfig pool_config;
      pool_config.capacity_tokens = 30;  // prompt 24 + 36 steps: 30 evictions per head
      pool_config.eviction = eviction;
      KvPoolCache pool(*l.backend, l.model->kv_shape(), pool_config);
      SelectionConfig config;
      config.policy = ParsePolicyKind(name).value();
      config.dense_layers = 1;
      config.budget_fraction = 0.4;
      auto inner = MakeSelectionPolicy(config, l.model->config(), &sidecar);
      ASSERT_TRUE(inner.ok());
      PoolObserver observer(std::move(*inner), pool, l.model->config());
      const DecodeRun run = Decode(*l.model, pool, &observer, 24, 36);
      EXPECT_EQ(run.tokens.size(), 36u);
      EXPECT_GT(pool.evictions(), 0);
      EXPECT_EQ(observer.misaligned_, 0) << name;
      EXPECT_EQ(observer.selected_evicted_, 0) << name;
    }
  }
}

TEST(KvPool, PrefillLongerThanTheCapacityIsRefused) {
  Loaded l = LoadModel(testing::FixturePath("hf/llama31_gqa"));
  KvPoolConfig config;
  config.capacity_tokens = 8;
  KvPoolCache pool(*l.backend, l.model->kv_shape(), config);
  ASSERT_TRUE(pool.Open(1, 100).ok());
  auto tokens = RandomTokens(12, l.model->config().vocab_size, 1);
  std::vector<float> logits(l.model->config().vocab_size);
  ForwardChunk c{1, 0, tokens, false};
  auto st = DecodeStep(*l.model, pool).Forward({&c, 1}, logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("capacity of 8"), std::string::npos) << st;
}

}  // namespace
}  // namespace infinigen
