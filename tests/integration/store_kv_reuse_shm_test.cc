// Row reuse over the shm transport (a GPU worker beside a KV store process: the store's arena
// mapped here, its answers over gRPC): the store runs in this process behind a real gRPC server
// on 127.0.0.1, the worker's side is the device-like CPU backend (memory the host cannot read,
// side-queue work run only when joined) with InfiniGen choosing rows there. A gather's block
// tables come back over gRPC, often after the batch was submitted, so such a gather's misses
// are moved at its fetch, on the backend's own queue, not the side queue. Tokens and logits
// equal the resident cache's bit for bit with reuse and without, and reuse moves less than half
// the bytes.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <functional>

#include "absl/strings/str_cat.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "kv_store/client/kv_store_client.h"
#include "kv_store/service/kvstore_service.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

TEST(StoreReuseOverShm, RowsKeptOnTheDeviceChangeNoBitAndMoveFewerBytes) {
  testing::LoadedModel l = testing::LoadModel(testing::FixturePath("hf/llama31_gqa"));
  ASSERT_NE(l.model, nullptr);
  PrepareOptions po;
  po.ratio = 0.5f;
  po.chunk_tokens = 40;
  auto sidecar = PrepareInfinigen(*l.model, *l.ckpt,
                                  testing::RandomTokens(96, l.model->config().vocab_size, 5), po);
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  ASSERT_TRUE(AttachSidecar(*l.model, *l.ckpt, *sidecar).ok());
  testing::DeviceLikeCpuBackend device;
  auto on_device = Model::Load(*l.ckpt, device);
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  ASSERT_TRUE(AttachSidecar(**on_device, *l.ckpt, *sidecar).ok());
  auto skew = UploadPartialSkew(*sidecar, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  config.dense_layers = 1;
  config.budget_fraction = 0.3;
  auto policy = [&](std::shared_ptr<const PartialSkewOnBackend> on) {
    auto p = MakeSelectionPolicy(config, l.model->config(), &*sidecar, std::move(on));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  };

  // The store, shared memory and all, behind a gRPC server; the client maps its arena.
  KvStoreConfig sc;
  sc.capacity_bytes = 16 << 20;
  sc.huge_pages = false;
  sc.block_tokens = 8;  // rows across several blocks of every layer
  auto store = KvStore::Create(sc);
  ASSERT_TRUE(store.ok()) << store.status();
  KvStoreService service(**store);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  KvClientConfig cc;
  cc.transport = KvClientConfig::Transport::kShm;
  cc.address = "127.0.0.1:" + std::to_string(port);
  cc.owner = "reuse-test";
  auto client = MakeKvStoreClient(cc);
  ASSERT_TRUE(client.ok()) << client.status();

  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 2; ++i) {
    prompts.push_back(testing::RandomTokens(20 + 7 * i, l.model->config().vocab_size, 11 + i));
  }
  BackendKvCache resident(*l.backend, l.model->kv_shape());
  auto a = policy(nullptr), b = policy(nullptr);
  const testing::DecodeRun want =
      testing::Decode(*l.model, resident, {a.get(), b.get()}, prompts, 16, 8);
  std::vector<int64_t> waits;  // the backend's, each run's
  int64_t table_waits = 0;     // the store's for block tables, the last run's
  auto run = [&](std::function<int64_t(int64_t)> reuse_rows, uint64_t id_base,
                 bool plan_on_device = false) {
    StoreKvCacheOptions options;
    options.id_base = id_base;
    options.device_reads_mapped_rows = true;
    options.reuse_rows = std::move(reuse_rows);
    options.plan_on_device = plan_on_device;
    StoreKvCache cache(device, (*on_device)->kv_shape(), **client, options);
    EXPECT_TRUE(cache.device_gathers()) << "the shm client maps the store's arena";
    EXPECT_EQ(cache.plans_on_device(), plan_on_device);
    auto c = policy(*skew), d = policy(*skew);
    const int64_t before = device.counters().synchronizations;
    testing::DecodeRun got =
        testing::Decode(**on_device, cache, {c.get(), d.get()}, prompts, 16, 8);
    waits.push_back(device.counters().synchronizations - before);
    table_waits = cache.table_waits();
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
    return got;
  };
  const testing::DecodeRun plain = run(nullptr, 100);
  const testing::DecodeRun reused = run([](int64_t capacity) { return capacity + 1; }, 200);
  EXPECT_EQ(plain.bytes_reused, 0);
  EXPECT_GT(reused.bytes_reused, 0);
  EXPECT_LT(2 * reused.bytes_fetched, plain.bytes_fetched)
      << "moved " << reused.bytes_fetched << " of " << plain.bytes_fetched;
  // Planned on the device, a step's gathers read the arena by block table with no ticket of
  // their own, while the rows the step before sent are write-behind appends (they linger on
  // their way to the store): the cache asks the store for them once a step, for every sequence
  // (TablesFor), or they are read stale. Fewer backend waits: the device's plan ran, not the
  // host's.
  const testing::DecodeRun planned =
      run([](int64_t capacity) { return capacity + 1; }, 300, /*plan_on_device=*/true);
  EXPECT_EQ(planned.bytes_fetched, reused.bytes_fetched);
  ASSERT_EQ(waits.size(), 3u);
  EXPECT_LT(waits[2], waits[1]) << "planned on the device: " << waits[2] << " backend waits, "
                                << "on the host: " << waits[1];
  // One gRPC round trip a step for both sequences' rows, not one a sequence.
  EXPECT_EQ(table_waits, 16);
  client->reset();
  server->Shutdown();
}

// A store restarted on the same port: the client maps each new arena at its next Open, and the
// cache's gathers register it with the backend in place of the old one, whose registration goes
// (on a GPU it pins the old arena's pages, and a new mapping at the same address would read
// them); also when the store restarted twice since the last gather (an Open between mapped the
// arena in between: the third may lie where the first did). The streams decode as before.
TEST(StoreReuseOverShm, ARestartedStoresArenaTakesTheOldOnesRegistration) {
  testing::LoadedModel l = testing::LoadModel(testing::FixturePath("hf/llama31_gqa"));
  ASSERT_NE(l.model, nullptr);
  testing::DeviceLikeCpuBackend device;
  auto on_device = Model::Load(*l.ckpt, device);
  ASSERT_TRUE(on_device.ok()) << on_device.status();
  std::vector<std::vector<int32_t>> prompts = {
      testing::RandomTokens(20, l.model->config().vocab_size, 11),
      testing::RandomTokens(27, l.model->config().vocab_size, 12)};
  BackendKvCache resident(*l.backend, l.model->kv_shape());
  const testing::DecodeRun want =  // dense: every row fetched
      testing::Decode(*l.model, resident, {nullptr, nullptr}, prompts, 16, 4);

  KvStoreConfig sc;
  sc.capacity_bytes = 16 << 20;
  sc.huge_pages = false;
  sc.block_tokens = 8;
  std::unique_ptr<KvStore> store;
  std::unique_ptr<KvStoreService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  auto start = [&] {
    server.reset();
    service.reset();
    store = std::move(*KvStore::Create(sc));
    service = std::make_unique<KvStoreService>(*store);
    grpc::ServerBuilder builder;
    int bound = 0;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                             &bound);
    builder.RegisterService(service.get());
    server = builder.BuildAndStart();
    port = bound;
  };
  start();
  ASSERT_NE(port, 0);
  KvClientConfig cc;
  cc.transport = KvClientConfig::Transport::kShm;
  cc.address = "127.0.0.1:" + std::to_string(port);
  cc.owner = "restart-test";
  cc.renew_every = absl::ZeroDuration();
  auto client = MakeKvStoreClient(cc);
  ASSERT_TRUE(client.ok()) << client.status();
  StoreKvCacheOptions options;
  options.device_reads_mapped_rows = true;
  StoreKvCache cache(device, (*on_device)->kv_shape(), **client, options);
  ASSERT_TRUE(cache.device_gathers());
  for (int run = 0; run < 4; ++run) {
    SCOPED_TRACE(absl::StrCat("run ", run));
    if (run > 0) {
      server->Shutdown();
      start();  // the same port
    }
    if (run == 2) {  // an Open maps this arena; no gather reads it before the next restart
      SequenceSpec spec;
      spec.num_layers = 1;
      spec.num_kv_heads = 1;
      spec.head_dim = 8;
      ASSERT_TRUE((*client)->Open(999, spec).ok());
      ASSERT_TRUE((*client)->Close(999).ok());
      server->Shutdown();
      start();
    }
    const testing::DecodeRun got =
        testing::Decode(**on_device, cache, {nullptr, nullptr}, prompts, 16, 4);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
    // (The gathers read only registered memory: the arena mapped now is.)
    EXPECT_EQ(device.registered_regions(), 1u) << "the arena mapped now, and no older one";
  }
  client->reset();
  server->Shutdown();
}

}  // namespace
}  // namespace infinigen
