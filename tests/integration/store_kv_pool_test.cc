// The KV pool over the KV store (StoreKvCache with a pool, in-process store; rows read in place
// and copied) against the worker's resident KV pool (KvPoolCache), on the tiny fixtures: with
// every eviction policy, InfiniGen and dense decodes give the same tokens and logits bit for
// bit, evict as many tokens, and keep the store's rows within the share; a prompt longer than
// the share is kept whole; pooled sequences are not attached (their slots are not positions).
#include <gtest/gtest.h>

#include <tuple>

#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/kv_pool_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "tests/support/fixture_model.h"
#include "tests/support/in_process_store.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::Decode;
using testing::DecodeRun;
using testing::RandomTokens;

class StorePool : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override {
    l_ = testing::LoadModel(testing::FixturePath("hf/" + std::get<0>(GetParam())));
    ASSERT_NE(l_.model, nullptr);
    PrepareOptions po;
    po.ratio = 0.5f;
    po.chunk_tokens = 40;
    auto s = PrepareInfinigen(*l_.model, *l_.ckpt,
                              RandomTokens(96, l_.model->config().vocab_size, 5), po);
    ASSERT_TRUE(s.ok()) << s.status();
    sidecar_ = std::move(*s);
    ASSERT_TRUE(AttachSidecar(*l_.model, *l_.ckpt, sidecar_).ok());
  }
  std::unique_ptr<KvSelectionPolicy> Policy(const std::string& name) {
    SelectionConfig config;
    config.policy = ParsePolicyKind(name).value();
    config.dense_layers = 1;  // the fixtures have 2 layers: layer 1 chooses
    config.budget_fraction = 0.4;
    auto p = MakeSelectionPolicy(config, l_.model->config(), &sidecar_);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  StoreKvCacheOptions Options(const KvPoolConfig& pool) const {
    StoreKvCacheOptions options;
    options.id_base = 1000;
    options.read_in_place = std::get<1>(GetParam());
    options.pool = pool;
    return options;
  }

  testing::LoadedModel l_;
  InfinigenSidecar sidecar_;
};

TEST_P(StorePool, DecodesAsTheResidentPoolBitForBit) {
  const std::vector<std::vector<int32_t>> prompt = {
      RandomTokens(24, l_.model->config().vocab_size, 7)};
  for (EvictionPolicy eviction :
       {EvictionPolicy::kCounter, EvictionPolicy::kFifo, EvictionPolicy::kLru}) {
    for (const char* name : {"infinigen", "full"}) {
      for (int64_t chunk : {int64_t{1000}, int64_t{8}}) {
        SCOPED_TRACE(::testing::Message() << EvictionPolicyName(eviction) << ", " << name
                                          << ", prefill chunks of " << chunk);
        KvPoolConfig config;
        config.capacity_tokens = 30;  // prompt 24 + 36 steps: 30 evictions per head
        config.eviction = eviction;
        KvPoolCache resident(*l_.backend, l_.model->kv_shape(), config);
        auto p1 = Policy(name);
        const DecodeRun want = Decode(*l_.model, resident, {p1.get()}, prompt, 36, chunk);
        ASSERT_GT(resident.evictions(), 0);

        testing::InProcessStore store;
        ASSERT_NE(store.client, nullptr);
        StoreKvCache cache(*l_.backend, l_.model->kv_shape(), *store.client, Options(config));
        auto p2 = Policy(name);
        const DecodeRun got = Decode(*l_.model, cache, {p2.get()}, prompt, 36, chunk);
        EXPECT_EQ(got.tokens, want.tokens);
        EXPECT_EQ(got.logits, want.logits);
        EXPECT_EQ(store.store->Stats().evictions, resident.evictions());
        EXPECT_EQ(store.store->Stats().sequences, 0) << "closed";
      }
    }
  }
}

TEST_P(StorePool, TheStoreKeepsTheShareAndAPromptLongerThanItWhole) {
  const std::vector<std::vector<int32_t>> prompt = {
      RandomTokens(24, l_.model->config().vocab_size, 9)};
  KvPoolConfig share;
  share.capacity_tokens = 16;  // less than the prompt: it grows to the prompt's 24
  KvPoolConfig whole = share;
  whole.capacity_tokens = 24;
  KvPoolCache resident(*l_.backend, l_.model->kv_shape(), whole);
  auto p1 = Policy("infinigen");
  const DecodeRun want = Decode(*l_.model, resident, {p1.get()}, prompt, 20, 8);

  testing::InProcessStore store;
  ASSERT_NE(store.client, nullptr);
  StoreKvCache cache(*l_.backend, l_.model->kv_shape(), *store.client, Options(share));
  auto p2 = Policy("infinigen");
  const DecodeRun got = Decode(*l_.model, cache, {p2.get()}, prompt, 20, 8);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logits, want.logits);

  // By hand, to look at the store before Close: 24 + 19 tokens appended, 24 rows kept.
  ASSERT_TRUE(cache.Open(1, 256).ok());
  std::vector<float> logits(l_.model->config().vocab_size);
  std::vector<int32_t> tokens = prompt[0];
  tokens.insert(tokens.end(), want.tokens[0].begin(), want.tokens[0].end() - 1);
  ForwardChunk first{1, 0, std::span<const int32_t>(tokens).first(24), false, nullptr};
  ASSERT_TRUE(DecodeStep(*l_.model, cache).Forward({&first, 1}, logits).ok());
  for (size_t t = 24; t < tokens.size(); ++t) {
    ForwardChunk c{1, static_cast<int64_t>(t), std::span<const int32_t>(&tokens[t], 1), false,
                   nullptr};
    ASSERT_TRUE(DecodeStep(*l_.model, cache).Forward({&c, 1}, logits).ok());
  }
  ASSERT_TRUE(store.client->Flush(absl::Now() + absl::Seconds(5)).ok());
  for (int layer = 0; layer < l_.model->config().num_layers; ++layer) {
    EXPECT_EQ(*cache.NumSlots(1, layer), 24);
    auto blocks = store.store->Blocks(cache.StoreId(1), layer);
    ASSERT_TRUE(blocks.ok()) << blocks.status();
    EXPECT_EQ(blocks->rows, 24) << "layer " << layer;
    EXPECT_EQ(*store.store->Length(cache.StoreId(1), layer), static_cast<int64_t>(tokens.size()));
  }
  EXPECT_EQ(cache.Counters(1).evictions, static_cast<int64_t>(tokens.size()) - 24);
  // Its slots are not positions: another worker cannot take it over, nor this one again.
  const absl::StatusOr<int64_t> attached = cache.Attach(2, cache.StoreId(1), 10, 10);
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition) << attached.status();
  cache.Close(1);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, StorePool,
                         ::testing::Combine(::testing::Values("llama2_mha", "llama31_gqa",
                                                              "opt_preln"),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<StorePool::ParamType>& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) ? "_in_place" : "_copied");
                         });

}  // namespace
}  // namespace infinigen
