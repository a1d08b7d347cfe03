// The StoreKvCache suites' fixture (tests/integration/store_kv_cache_test.cc,
// store_kv_device_plan_test.cc): a tiny fixture model (its name and whether the store's rows
// are read in place are the parameters) with an InfiniGen sidecar, an in-process store, its
// client and a cache over it; the model on a backend the host cannot read; and a store whose
// blocks hold 4 rows.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/in_process_store.h"
#include "tests/support/test_paths.h"

namespace infinigen::testing {

// An in-process store whose arena blocks hold 4 rows of `shape` (a sequence's rows span several
// blocks of every layer), and its client (null after recording a failure).
struct SmallBlocks : InProcessStore {
  explicit SmallBlocks(const KvCacheShape& shape) : InProcessStore(BlocksOf4(shape)) {}
  static KvStoreConfig BlocksOf4(const KvCacheShape& shape) {
    KvStoreConfig sc = Config(16 << 20);
    sc.block_tokens = 4;
    sc.max_row_bytes = static_cast<int64_t>(shape.head_dim * DTypeSize(shape.dtype));
    return sc;
  }
};

class StoreCacheTest : public ::testing::TestWithParam<std::tuple<std::string, bool>> {
 protected:
  void SetUp() override {
    l_ = LoadModel(FixturePath("hf/" + std::get<0>(GetParam())));
    ASSERT_NE(l_.model, nullptr);
    InProcessStore in_process;
    ASSERT_NE(in_process.client, nullptr);
    store_ = std::move(in_process.store);
    client_ = std::move(in_process.client);
    StoreKvCacheOptions options;
    options.id_base = 1000;
    options.read_in_place = std::get<1>(GetParam());
    cache_ = std::make_unique<StoreKvCache>(*l_.backend, l_.model->kv_shape(), *client_, options);
    auto tokens = RandomTokens(96, l_.model->config().vocab_size, 5);
    PrepareOptions po;
    po.ratio = 0.5f;
    po.chunk_tokens = 40;
    auto s = PrepareInfinigen(*l_.model, *l_.ckpt, tokens, po);
    ASSERT_TRUE(s.ok()) << s.status();
    sidecar_ = std::move(*s);
    ASSERT_TRUE(AttachSidecar(*l_.model, *l_.ckpt, sidecar_).ok());
  }

  std::unique_ptr<KvSelectionPolicy> Policy(
      const std::string& name, std::shared_ptr<const PartialSkewOnBackend> skew = nullptr) {
    SelectionConfig config;
    config.policy = ParsePolicyKind(name).value();
    config.dense_layers = 1;  // the fixtures have 2 layers: make layer 1 sparse
    config.budget_fraction = 0.3;
    auto p = MakeSelectionPolicy(config, l_.model->config(), &sidecar_, std::move(skew));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  // The fixture's model on a backend the host cannot read, the sidecar attached (null after
  // recording a failure); and a store cache's options there (the GPU reads the store's rows).
  std::unique_ptr<Model> OnDevice(DeviceLikeCpuBackend& device) {
    auto loaded = Model::Load(*l_.ckpt, device);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (!loaded.ok()) return nullptr;
    const absl::Status attached = AttachSidecar(**loaded, *l_.ckpt, sidecar_);
    EXPECT_TRUE(attached.ok()) << attached;
    return attached.ok() ? std::move(*loaded) : nullptr;
  }
  // The sidecar's partial skew in `device`'s memory, for policies choosing there (null after
  // recording a failure).
  std::shared_ptr<const PartialSkewOnBackend> SkewOn(Backend& device) {
    auto skew = UploadPartialSkew(sidecar_, device);
    EXPECT_TRUE(skew.ok()) << skew.status();
    return skew.ok() ? *skew : nullptr;
  }
  StoreKvCacheOptions DeviceStoreOptions() const {
    StoreKvCacheOptions options;
    options.read_in_place = std::get<1>(GetParam());
    options.device_reads_mapped_rows = true;
    return options;
  }
  std::vector<std::vector<int32_t>> Prompts(size_t n) {
    std::vector<std::vector<int32_t>> p;
    for (size_t i = 0; i < n; ++i) {
      p.push_back(RandomTokens(20 + 7 * i, l_.model->config().vocab_size, 11 + i));
    }
    return p;
  }

  testing::LoadedModel l_;
  std::unique_ptr<KvStore> store_;
  std::unique_ptr<KvStoreClient> client_;
  std::unique_ptr<StoreKvCache> cache_;
  InfinigenSidecar sidecar_;
};

// The suites' parameters: each tiny model, its rows read in place or copied; and their names.
inline auto StoreCacheParams() {
  return ::testing::Combine(::testing::Values("llama2_mha", "llama31_gqa", "opt_preln"),
                            ::testing::Bool());
}
inline std::string StoreCacheParamName(
    const ::testing::TestParamInfo<StoreCacheTest::ParamType>& info) {
  return std::get<0>(info.param) + (std::get<1>(info.param) ? "_in_place" : "_copied");
}

}  // namespace infinigen::testing
