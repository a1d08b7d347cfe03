// Rows planned on the device over a real model's 30 layers (SmolLM2, q8 weights, bf16 K/V), on
// the CPU stand-in of a GPU (testing::DeviceLikeCpuBackend): the fixtures have 2 layers, one of
// them sparse, so only here does the decode step pipeline the plans of many layers, each
// prefetch's plan and gather on the side queue, run as late as a GPU may run them (at the join,
// a layer later), while the main queue chooses the next layers' rows. The device's plan must
// give the host's plan's tokens and logits bit for bit, and every plan must fit (a plan that
// read a choice the next layer had already overwritten does not: the race this test caught).
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "gpu_worker/model/checkpoint.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/in_process_store.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

TEST(DevicePlanSmolLm2, EveryLayerPlannedOnTheDeviceGivesTheHostPlansTokens) {
  IG_REQUIRE_FILE(testing::SmolLm2Path(), "SmolLM2 GGUF (scripts/setup.sh fetches it)");
  auto ckpt = Checkpoint::Open(testing::SmolLm2Path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  CpuBackendOptions o;  // as the main job serves on the CPU
  o.weight_format = WeightFormat::kQ8;
  o.kv_dtype = DType::kBF16;
  testing::DeviceLikeCpuBackend device(o);
  auto model = Model::Load(**ckpt, device);
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  ASSERT_GE(m.config().num_layers, 6);
  const int64_t vocab = m.config().vocab_size;
  PrepareOptions po;
  po.chunk_tokens = 128;
  auto sidecar = PrepareInfinigen(m, **ckpt, testing::RandomTokens(256, vocab, 3), po);
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  ASSERT_TRUE(AttachSidecar(m, **ckpt, *sidecar).ok());
  auto skew = UploadPartialSkew(*sidecar, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  SelectionConfig selection;  // the worker's InfiniGen, its budget floor low enough to select
  selection.policy = PolicyKind::kInfinigen;
  selection.budget_fraction = 0.3;
  const std::vector<std::vector<int32_t>> prompts = {testing::RandomTokens(300, vocab, 21),
                                                     testing::RandomTokens(341, vocab, 22),
                                                     testing::RandomTokens(277, vocab, 23)};
  testing::InProcessStore store(size_t{256} << 20);
  ASSERT_NE(store.client, nullptr);
  auto run = [&](bool plan) {
    SCOPED_TRACE(plan ? "planned on the device" : "the host's plan");
    StoreKvCacheOptions options;  // as the worker sets them on a GPU (worker_runtime.cc)
    options.device_reads_mapped_rows = true;
    options.device_resident_layers = selection.dense_layers;
    options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
    options.plan_on_device = plan;
    StoreKvCache cache(device, m.kv_shape(), *store.client, options);
    EXPECT_TRUE(cache.device_gathers());
    EXPECT_EQ(cache.plans_on_device(), plan);
    std::vector<std::unique_ptr<KvSelectionPolicy>> policies;
    std::vector<KvSelectionPolicy*> raw;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto p = MakeSelectionPolicy(selection, m.config(), &*sidecar, *skew);
      EXPECT_TRUE(p.ok()) << p.status();
      if (!p.ok()) return testing::DecodeRun{};
      raw.push_back(p->get());
      policies.push_back(std::move(*p));
    }
    return testing::Decode(m, cache, raw, prompts, /*steps=*/10, /*chunk=*/128,
                           /*capacity=*/400);
  };
  const testing::DecodeRun host = run(false), planned = run(true);
  ASSERT_EQ(planned.tokens.size(), prompts.size());
  for (const auto& t : planned.tokens) EXPECT_EQ(t.size(), 10u);
  EXPECT_EQ(planned.tokens, host.tokens);
  EXPECT_EQ(planned.logits, host.logits);
  EXPECT_EQ(planned.prefetch_misses, 0);
  EXPECT_GT(planned.bytes_reused, 0) << "rows kept between steps";
  ASSERT_GT(planned.profile.steps, 0);
  EXPECT_EQ(planned.profile.backend.synchronizations, planned.profile.steps)
      << "the device's plan waits once a step (for the logits)";
  EXPECT_GE(host.profile.backend.synchronizations,
            host.profile.steps * (m.config().num_layers - selection.dense_layers))
      << "the host's plan waits once a sparse layer";
}

}  // namespace
}  // namespace infinigen
