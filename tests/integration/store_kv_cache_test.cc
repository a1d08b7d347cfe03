// The model over the KV store (StoreKvCache, in-process transport; rows read in place in the
// store's arena, and copied into staging) against the model over its own resident cache, on the
// tiny fixtures: dense attention gives the same logits bit for bit,
// InfiniGen reads exactly the rows it selected and gives the same logits as over the resident
// cache, batches of several sequences equal each sequence alone, chunked prefill reads back
// from the store, InfiniGen's rows for layer i are prefetched during layer i-1 and found there,
// policies that must read stored keys themselves are refused, and host policies run on a
// backend the host cannot read through copies of what they read.
#include "gpu_worker/kv/store_kv_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/store_cache_fixture.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::Decode;
using testing::DecodeRun;
using testing::DeviceLikeCpuBackend;
using testing::RandomTokens;

using testing::SmallBlocks;
using StoreCache = testing::StoreCacheTest;

TEST_P(StoreCache, DenseDecodeEqualsTheResidentCacheBitForBit) {
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  const auto prompts = Prompts(1);
  const DecodeRun want = Decode(*l_.model, resident, {nullptr}, prompts, 12, 1000);
  const DecodeRun got = Decode(*l_.model, *cache_, {nullptr}, prompts, 12, 1000);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logits, want.logits);
  // Every decode step read each layer's rows from a fetch started before the layer (layer 0's
  // before the embedding), never after its own append.
  EXPECT_GE(got.prefetch_hits, 11 * l_.model->config().num_layers);
  EXPECT_EQ(got.prefetch_misses, 0);
  // A prefetch answers row addresses in the arena when reading in place, packed rows if not.
  ASSERT_TRUE(cache_->Open(1, 64).ok());
  std::vector<float> logits(l_.model->config().vocab_size);
  ForwardChunk c{1, 0, prompts[0], false, nullptr};
  ASSERT_TRUE(DecodeStep(*l_.model, *cache_).Forward({&c, 1}, logits).ok());
  const std::vector<int32_t> slots(l_.model->config().num_kv_heads, 3);  // row 3 of every head
  ASSERT_TRUE(cache_->Prefetch(1, 0, slots.data(), 1).ok());
  auto kv = cache_->Fetch(1, 0);
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_EQ(kv->k.rows != nullptr, std::get<1>(GetParam()));
  EXPECT_EQ(kv->k.data == nullptr, std::get<1>(GetParam()));
  if (kv->k.rows != nullptr) {
    const uint8_t* base = store_->arena().base();
    const size_t arena =
        static_cast<size_t>(store_->arena().num_blocks()) * store_->arena().block_bytes();
    for (size_t g = 0; g < slots.size(); ++g) {
      for (const void* row : {kv->k.rows[g], kv->v.rows[g]}) {
        const uint8_t* p = static_cast<const uint8_t*>(row);
        EXPECT_TRUE(p >= base && p < base + arena) << "head " << g << ": not in the arena";
      }
    }
  }
  cache_->Close(1);
  // Chunked prefill reads the earlier chunks back from the store.
  const DecodeRun chunked = Decode(*l_.model, *cache_, {nullptr}, prompts, 12, 8);
  EXPECT_EQ(chunked.tokens, want.tokens);
  auto stats = store_->Stats();
  EXPECT_EQ(stats.sequences, 0) << "every sequence was closed in the store";
}

TEST_P(StoreCache, InfinigenFetchesOnlyItsSelectionAndMatchesTheResidentCache) {
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  const auto prompts = Prompts(1);
  auto p1 = Policy("infinigen");
  const DecodeRun want = Decode(*l_.model, resident, {p1.get()}, prompts, 16, 1000);
  auto p2 = Policy("infinigen");
  // Count the bytes: open the sequence by hand once more to read the counters before Close.
  const int64_t vocab = l_.model->config().vocab_size;
  ASSERT_TRUE(cache_->Open(1, 256).ok());
  std::vector<float> logits(vocab);
  ForwardChunk first{1, 0, prompts[0], false, p2.get()};
  DecodeStep step(*l_.model, *cache_);
  ASSERT_TRUE(step.Forward({&first, 1}, logits).ok());
  std::vector<float> got_logits;
  for (int64_t s = 0; s < 16; ++s) {
    int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(next, want.tokens[0][s]) << "step " << s;
    ForwardChunk c{1, static_cast<int64_t>(prompts[0].size()) + s,
                   std::span<const int32_t>(&next, 1), false, p2.get()};
    auto st = step.Forward({&c, 1}, logits);
    ASSERT_TRUE(st.ok()) << st;
    got_logits.insert(got_logits.end(), logits.begin(), logits.end());
  }
  EXPECT_EQ(got_logits, want.logits);
  const int64_t hits = step.prefetch_hits(), misses = step.prefetch_misses();
  if (std::get<1>(GetParam())) {
    // Read in place, the host policy's exact selection is looked up at its layer: nothing is
    // prefetched (the addresses of every row cost more than the choice saves).
    EXPECT_EQ(hits + misses, 0) << hits << " hits, " << misses << " misses";
  } else {
    // Layer 1's rows were prefetched during layer 0 (the cross-layer pipeline), and the exact
    // selection was found among the candidates at most steps.
    EXPECT_GT(hits, 0);
    EXPECT_GE(hits, 4 * misses) << hits << " hits, " << misses << " misses";
  }
  const FetchCounters counters = cache_->Counters(1);
  EXPECT_GT(counters.bytes_fetched, 0);
  // Layer 0 is dense (all rows), layer 1 reads its selection: ~30% of its rows.
  EXPECT_LT(counters.bytes_fetched, counters.bytes_full * 0.75);
  cache_->Close(1);
  p2->Release(1);
}

TEST_P(StoreCache, ABatchEqualsEachSequenceAlone) {
  const auto prompts = Prompts(3);
  auto pa = Policy("infinigen");
  auto pb = Policy("window");
  const DecodeRun batched =
      Decode(*l_.model, *cache_, {pa.get(), nullptr, pb.get()}, prompts, 10, 1000);
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  std::vector<std::unique_ptr<KvSelectionPolicy>> own;
  own.push_back(Policy("infinigen"));
  own.push_back(nullptr);
  own.push_back(Policy("window"));
  for (size_t i = 0; i < prompts.size(); ++i) {
    const DecodeRun alone = Decode(*l_.model, resident, {own[i].get()}, {prompts[i]}, 10, 1000);
    EXPECT_EQ(batched.tokens[i], alone.tokens[0]) << "sequence " << i;
  }
}

// The prefetches of a batch travel as one gather; if it fails because of one sequence (here
// closed in the store behind the worker's back), the others still get their rows and only that
// one fails.
TEST_P(StoreCache, APrefetchBatchWithAFailingSequenceFailsOnlyThatOne) {
  const auto prompts = Prompts(2);
  std::vector<float> logits(l_.model->config().vocab_size);
  for (SequenceId seq : {1, 2}) {
    ASSERT_TRUE(cache_->Open(seq, 64).ok());
    ForwardChunk c{seq, 0, prompts[seq - 1], false, nullptr};
    ASSERT_TRUE(DecodeStep(*l_.model, *cache_).Forward({&c, 1}, logits).ok());
  }
  const int heads = l_.model->config().num_kv_heads;
  const size_t row_bytes = l_.model->kv_shape().head_dim * DTypeSize(l_.model->kv_shape().dtype);
  const std::vector<int32_t> slots(heads, 5);  // row 5 of every head
  auto rows = [&](const KvLayerView& kv) {     // K row bytes of each head, one row per head
    std::vector<uint8_t> out;
    for (int g = 0; g < heads; ++g) {
      const uint8_t* p = kv.k.rows != nullptr
                             ? static_cast<const uint8_t*>(kv.k.rows[g])
                             : static_cast<const uint8_t*>(kv.k.data) + g * row_bytes;
      out.insert(out.end(), p, p + row_bytes);
    }
    return out;
  };
  ASSERT_TRUE(cache_->Prefetch(1, 0, slots.data(), 1).ok());
  auto alone = cache_->Fetch(1, 0);
  ASSERT_TRUE(alone.ok()) << alone.status();
  const std::vector<uint8_t> want = rows(*alone);

  cache_->BeginPrefetches();
  ASSERT_TRUE(cache_->Prefetch(1, 0, slots.data(), 1).ok());
  ASSERT_TRUE(cache_->Prefetch(2, 0, slots.data(), 1).ok());
  ASSERT_TRUE(store_->Close(1000 + 2).ok());  // the store loses sequence 2
  cache_->SubmitPrefetches();
  auto got = cache_->Fetch(1, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(rows(*got), want);
  EXPECT_EQ(cache_->Fetch(2, 0).status().code(), absl::StatusCode::kNotFound);
  cache_->Close(1);
  cache_->Close(2);
}

// The GPU path of the store cache (device_reads_mapped_rows) on a backend that is a device
// only in name: batches decode to the resident cache's logits bit for bit, every decode step's
// rows gathered by block table from the registered arena (DeviceLikeCpuBackend refuses tables,
// slots or staging outside its own memory, and an arena that is not registered).
TEST_P(StoreCache, RowsGatheredByBlockTableOnADeviceBackendMatchTheResidentCache) {
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  const auto prompts = Prompts(2);
  const DecodeRun want = Decode(*l_.model, resident, {nullptr, nullptr}, prompts, 10, 1000);
  DeviceLikeCpuBackend device;
  StoreKvCacheOptions options;
  options.read_in_place = std::get<1>(GetParam());
  options.device_reads_mapped_rows = true;
  StoreKvCache cache(device, l_.model->kv_shape(), *client_, options);
  EXPECT_EQ(cache.device_gathers(), std::get<1>(GetParam()));
  EXPECT_FALSE(cache.addresses_only()) << "the device reads copies, not the rows in place";
  const DecodeRun got = Decode(*l_.model, cache, {nullptr, nullptr}, prompts, 10, 1000);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.logits, want.logits);
  if (cache.device_gathers()) {
    // 9 of the 10 steps read every stored row of both layers, for both sequences; the decode
    // steps' prefetches on the side queue (which runs them only when the cache joins it), one
    // fork for each.
    EXPECT_GT(device.rows_gathered(), 9 * 2 * l_.model->config().num_layers);
    EXPECT_GE(device.side_gathers(), 2 * 9 * 2 * l_.model->config().num_layers);
    EXPECT_EQ(device.side_forks(), device.side_gathers() / 2);
    // A join runs one layer's gathers (K and V of each sequence), never the next layer's too:
    // those overlap the layer being attended.
    EXPECT_EQ(device.most_gathers_joined(), 2 * 2);

  } else {
    EXPECT_EQ(device.rows_gathered(), 0);
  }
}

// The same over a store whose blocks hold 4 rows: each sequence's rows span several blocks of
// every layer and decode steps cross into new ones (the block tables on the device grow
// between steps), with InfiniGen choosing rows on the device; and sequences opened with room
// for 2 tokens only, whose tables (and staging) must grow past what they were opened with.
// Tokens and logits equal the resident cache's bit for bit either way (and where rows are copied
// instead, through staging, over the same small blocks).
TEST_P(StoreCache, BlockTablesOnTheDeviceFollowRowsAcrossBlocksAndPastTheCapacity) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  Model& on_device = *loaded;
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const KvCacheShape shape = on_device.kv_shape();
  SmallBlocks small(shape);
  ASSERT_NE(small.client, nullptr);
  auto client = &small.client;
  ASSERT_EQ(small.client->mapped_memory().block_bytes, 4 * shape.head_dim * DTypeSize(shape.dtype));
  const auto prompts = Prompts(2);  // 20 and 27 tokens: 5 and 7 blocks, then 3 more decoded
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  {
    SCOPED_TRACE("InfiniGen, room for every token");
    auto a = Policy("infinigen"), b = Policy("infinigen");
    const DecodeRun want = Decode(*l_.model, resident, {a.get(), b.get()}, prompts, 12, 8);
    StoreKvCache cache(device, shape, **client, DeviceStoreOptions());
    ASSERT_EQ(cache.device_gathers(), std::get<1>(GetParam()));  // copied: through staging
    auto c = Policy("infinigen", *skew), d = Policy("infinigen", *skew);
    const int64_t gathered_before = device.rows_gathered();
    const int64_t side_before = device.side_gathers();
    const DecodeRun got = Decode(on_device, cache, {c.get(), d.get()}, prompts, 12, 8);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
    EXPECT_EQ(device.rows_gathered() > gathered_before, cache.device_gathers());
    EXPECT_EQ(device.side_gathers() > side_before, cache.device_gathers());
  }
  {
    SCOPED_TRACE("dense, opened with room for 2 tokens");
    const DecodeRun want = Decode(*l_.model, resident, {nullptr, nullptr}, prompts, 12, 8);
    StoreKvCache cache(device, shape, **client, DeviceStoreOptions());
    const DecodeRun got =
        Decode(on_device, cache, {nullptr, nullptr}, prompts, 12, 8, /*capacity=*/2);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
  }
}

// A sidecar wider than the backend's row choice reads is refused when the policy is made (a
// worker refuses it at start), not at the first decode step (where a GPU's ChooseRows refused
// it before); the host's choice, which has no such limit, still takes it.
TEST_P(StoreCache, ASidecarWiderThanTheBackendsRowChoiceIsRefusedWhenThePolicyIsMade) {
  DeviceLikeCpuBackend device;
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  ASSERT_GT(sidecar_.partial_dim, 1);
  SelectionConfig config;
  config.policy = PolicyKind::kInfinigen;
  ASSERT_TRUE(MakeSelectionPolicy(config, l_.model->config(), &sidecar_, *skew).ok());
  device.set_max_choice_partial_dim(static_cast<int>(sidecar_.partial_dim) - 1);
  auto refused = MakeSelectionPolicy(config, l_.model->config(), &sidecar_, *skew);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("does not fit this backend's row choice"));
  EXPECT_TRUE(MakeSelectionPolicy(config, l_.model->config(), &sidecar_).ok()) << "on the host";
}

// Row reuse (StoreKvCacheOptions::reuse_rows) where the GPU gathers by block table: InfiniGen
// choosing on the device, a batch of two decoding 16 steps, over the default store and one of
// 4-row blocks (tables growing while rows are kept). Tokens and logits equal the resident
// cache's bit for bit (the decode attention of both in one call a layer); prefetches find rows
// an earlier step moved (bytes_reused) and move less than half the bytes they move without
// reuse. The same on the CPU backend where the transport copies rows into staging. With room for
// fewer rows than a prefetch lists, every read moves all its rows, as without reuse (and still bit
// for bit).
TEST_P(StoreCache, RowsKeptOnTheDeviceBetweenStepsChangeNoBitAndMoveFewerBytes) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  Model& on_device = *loaded;
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const KvCacheShape shape = on_device.kv_shape();
  SmallBlocks small(shape);
  ASSERT_NE(small.client, nullptr);
  const auto prompts = Prompts(2);
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  auto a = Policy("infinigen"), b = Policy("infinigen");
  const DecodeRun want = Decode(*l_.model, resident, {a.get(), b.get()}, prompts, 16, 8);
  for (KvStoreClient* client : {client_.get(), small.client.get()}) {
    SCOPED_TRACE(client == client_.get() ? "default blocks" : "4-row blocks");
    auto run = [&](std::function<int64_t(int64_t)> reuse_rows) {
      StoreKvCacheOptions options = DeviceStoreOptions();
      options.reuse_rows = std::move(reuse_rows);
      StoreKvCache cache(device, shape, *client, options);
      EXPECT_EQ(cache.ReuseRows(256) > 0, cache.device_gathers() && options.reuse_rows != nullptr);
      auto c = Policy("infinigen", *skew), d = Policy("infinigen", *skew);
      const int64_t batches = device.attention_batches();
      DecodeRun got = Decode(on_device, cache, {c.get(), d.get()}, prompts, 16, 8);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.logits, want.logits);
      // The batch's decode attention in one call a layer, both sequences in it.
      EXPECT_EQ(device.attention_batches() - batches, 16 * on_device.config().num_layers);
      EXPECT_EQ(device.most_attention_batch(), 2);
      return got;
    };
    // The CPU backend over the same store: rows read in place move nothing (no reuse), rows
    // copied by the transport into staging (what gRPC and UCX do) are kept as on a GPU.
    auto run_cpu = [&](std::function<int64_t(int64_t)> reuse_rows) {
      StoreKvCacheOptions options;
      options.read_in_place = std::get<1>(GetParam());
      options.reuse_rows = std::move(reuse_rows);
      StoreKvCache cache(*l_.backend, l_.model->kv_shape(), *client, options);
      EXPECT_EQ(cache.ReuseRows(256) > 0, !cache.addresses_only() && options.reuse_rows != nullptr);
      auto c = Policy("infinigen"), d = Policy("infinigen");
      DecodeRun got = Decode(*l_.model, cache, {c.get(), d.get()}, prompts, 16, 8);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.logits, want.logits);
      return got;
    };
    {
      SCOPED_TRACE("CPU backend");
      const DecodeRun plain = run_cpu(nullptr);
      const DecodeRun reused = run_cpu([](int64_t capacity) { return capacity + 1; });
      if (!std::get<1>(GetParam())) {  // copied: kept
        EXPECT_GT(reused.bytes_reused, 0);
        EXPECT_LT(2 * reused.bytes_fetched, plain.bytes_fetched)
            << "moved " << reused.bytes_fetched << " of " << plain.bytes_fetched;
      } else {
        EXPECT_EQ(reused.bytes_reused, 0);
        EXPECT_EQ(reused.bytes_fetched, plain.bytes_fetched);
      }
    }
    const DecodeRun plain = run(nullptr);
    const DecodeRun reused = run([](int64_t capacity) { return capacity + 1; });
    const DecodeRun too_few = run([](int64_t) { return 4; });
    EXPECT_EQ(plain.bytes_reused, 0);
    EXPECT_EQ(too_few.bytes_reused, 0);
    EXPECT_EQ(too_few.bytes_fetched, plain.bytes_fetched);
    if (std::get<1>(GetParam())) {  // the GPU gathers: rows are kept
      EXPECT_GT(reused.bytes_reused, 0);
      EXPECT_LT(2 * reused.bytes_fetched, plain.bytes_fetched)
          << "moved " << reused.bytes_fetched << " of " << plain.bytes_fetched;
    } else {
      EXPECT_EQ(reused.bytes_reused, 0);
      EXPECT_EQ(reused.bytes_fetched, plain.bytes_fetched);
    }
  }
}

// Row reuse's bookkeeping follows what really reached the device: rows move once and are then
// found where Placement says; a reuse prefetch dropped before its rows moved (a second prefetch
// of the layer replaced it unfetched) leaves the layer's rows unknown, so the next prefetch of
// the same rows moves them again; rows appended since move, the others stay. Rows are checked
// by value, read back from the device.
TEST(StoreCacheReuse, RowsMoveOnceAndAgainOnlyIfTheyNeverLanded) {
  DeviceLikeCpuBackend device;
  KvStoreConfig sc;
  sc.capacity_bytes = 16 << 20;
  sc.shared_memory = false;
  auto store = KvStore::Create(sc);
  ASSERT_TRUE(store.ok()) << store.status();
  KvClientConfig cc;
  cc.transport = KvClientConfig::Transport::kInProcess;
  cc.store = store->get();
  auto client = MakeKvStoreClient(cc);
  ASSERT_TRUE(client.ok()) << client.status();
  const KvCacheShape shape{2, 2, 8, DType::kF32};
  const int64_t heads = shape.num_kv_heads, hd = shape.head_dim, width = heads * hd;
  StoreKvCacheOptions options;
  options.device_reads_mapped_rows = true;
  options.reuse_rows = [](int64_t) { return 6; };
  StoreKvCache cache(device, shape, **client, options);
  ASSERT_TRUE(cache.device_gathers());
  ASSERT_EQ(cache.ReuseRows(32), 6);
  ASSERT_TRUE(cache.Open(1, 32).ok());
  // K of token t, head g, channel c: 1000 * generation + 10 * t + g + c / 100; V its negative.
  auto append = [&](int64_t start, int64_t n, int generation) {
    std::vector<float> k(static_cast<size_t>(n * width)), v(k.size());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < width; ++i) {
        k[t * width + i] = 1000.0f * generation + 10.0f * (start + t) + static_cast<float>(i / hd) +
                           static_cast<float>(i % hd) / 100.0f;
        v[t * width + i] = -k[t * width + i];
      }
    }
    auto kb = device.Allocate(k.size() * 4), vb = device.Allocate(v.size() * 4);
    ASSERT_TRUE(kb.ok() && vb.ok());
    ASSERT_TRUE(device.CopyToDevice(k.data(), (*kb)->data(), k.size() * 4).ok());
    ASSERT_TRUE(device.CopyToDevice(v.data(), (*vb)->data(), v.size() * 4).ok());
    for (int layer = 0; layer < shape.num_layers; ++layer) {
      const MatView km{(*kb)->data(), DType::kF32, n, width, width};
      const MatView vm{(*vb)->data(), DType::kF32, n, width, width};
      const absl::Status appended = cache.Append(1, layer, start, km, vm);
      ASSERT_TRUE(appended.ok()) << appended;
    }
  };
  // Reads `slots` (the same list for both heads) of layer 1 placed, and checks every row.
  auto read = [&](const std::vector<int32_t>& list, int generation_from_16) -> int64_t {
    std::vector<int32_t> slots = list;
    slots.insert(slots.end(), list.begin(), list.end());
    const int64_t count = static_cast<int64_t>(list.size());
    const int64_t moved_before = cache.Counters(1).bytes_fetched;
    EXPECT_TRUE(cache.Prefetch(1, 1, slots.data(), count, 1, /*placed=*/true).ok());
    const StreamedKvCache::RowPlacement placed = cache.Placement(1, 1);
    EXPECT_NE(placed.rows, nullptr);
    auto view = cache.Fetch(1, 1);
    EXPECT_TRUE(view.ok()) << view.status();
    if (!view.ok() || placed.rows == nullptr) return -1;
    std::vector<float> k(static_cast<size_t>(heads * (placed.rows_per_head + 1) * hd));
    std::vector<float> v(k.size());
    EXPECT_TRUE(device.CopyToHost(view->k.data, k.data(), k.size() * 4).ok());
    EXPECT_TRUE(device.CopyToHost(view->v.data, v.data(), v.size() * 4).ok());
    for (int64_t g = 0; g < heads; ++g) {
      for (int64_t j = 0; j < count; ++j) {
        const int64_t row = g * placed.rows_per_head + placed.rows[g * count + j];
        const int64_t t = list[j];
        const int generation = t >= 16 ? generation_from_16 : 0;
        const float want = 1000.0f * generation + 10.0f * t + static_cast<float>(g);
        EXPECT_EQ(k[row * hd], want) << "slot " << t << " head " << g;
        EXPECT_EQ(k[row * hd + 3], want + 0.03f) << "slot " << t << " head " << g;
        EXPECT_EQ(v[row * hd], -want) << "slot " << t << " head " << g;
      }
    }
    return (cache.Counters(1).bytes_fetched - moved_before) / (2 * hd * 4);
  };
  append(0, 16, 0);
  EXPECT_EQ(read({1, 4, 9, 12}, 0), 2 * 4);  // every row moves
  EXPECT_EQ(read({1, 4, 9, 12}, 0), 0);      // none
  EXPECT_EQ(read({0, 4, 9, 13, 15}, 0), 2 * 3);
  // A placed prefetch replaced by another before it was fetched: its misses never moved.
  const std::vector<int32_t> dropped = {2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(cache.Prefetch(1, 1, dropped.data(), 6, 1, /*placed=*/true).ok());
  const std::vector<int32_t> other = {0, 1, 0, 1};
  ASSERT_TRUE(cache.Prefetch(1, 1, other.data(), 2, 0).ok());
  ASSERT_TRUE(cache.Fetch(1, 1).ok());
  EXPECT_EQ(read({2, 3, 4, 5, 6, 7}, 0), 2 * 6);
  EXPECT_EQ(read({2, 3, 4, 5, 6, 7}, 0), 0);
  // Tokens appended since: theirs move, the others are still there.
  append(16, 4, 7);
  EXPECT_EQ(read({4, 5, 16, 17, 19}, 7), 2 * 3);
  EXPECT_EQ(read({4, 5, 16, 17, 19}, 7), 0);
  cache.Close(1);
}

// Forwards to a policy, counting the pointers it is handed that lie in the device's memory
// (which host code on a GPU machine could not read) and the selections it makes.
class HostPointerCheck final : public KvSelectionPolicy {
 public:
  HostPointerCheck(KvSelectionPolicy& inner, const DeviceLikeCpuBackend& device)
      : inner_(inner), device_(device) {}
  std::string Name() const override { return inner_.Name(); }
  SpeculationInput speculation_input() const override { return inner_.speculation_input(); }
  bool wants_attention_weights() const override { return inner_.wants_attention_weights(); }
  bool needs_resident_kv() const override { return inner_.needs_resident_kv(); }
  absl::Status OnKeys(const LayerKeys& keys) override {
    for (const void* p : std::initializer_list<const void*>{keys.k, keys.q, keys.slots,
                                                            keys.kv.k.data, keys.kv.v.data}) {
      Check(p);
    }
    return inner_.OnKeys(keys);
  }
  absl::Status Select(const SelectRequest& r, Selection& out) override {
    CheckRequest(r);
    absl::Status st = inner_.Select(r, out);
    if (st.ok() && !out.all) ++sparse_selections_;
    return st;
  }
  bool Preselect(const SelectRequest& r, Selection& out) override {
    CheckRequest(r);
    return inner_.Preselect(r, out);
  }
  void OnAttentionWeights(SequenceId seq, int layer, const Selection& selection,
                          const float* weights, int64_t rows) override {
    Check(weights);
    inner_.OnAttentionWeights(seq, layer, selection, weights, rows);
  }
  void Release(SequenceId seq) override { inner_.Release(seq); }

  int64_t device_pointers() const { return device_pointers_; }
  int64_t sparse_selections() const { return sparse_selections_; }

 private:
  void Check(const void* p) {
    if (p != nullptr && device_.Owns(p)) ++device_pointers_;
  }
  void CheckRequest(const SelectRequest& r) {
    for (const void* p : std::initializer_list<const void*>{r.q, r.speculated_q, r.current_slots,
                                                            r.kv.k.data, r.kv.v.data}) {
      Check(p);
    }
  }

  KvSelectionPolicy& inner_;
  const DeviceLikeCpuBackend& device_;
  int64_t device_pointers_ = 0, sparse_selections_ = 0;
};

// Host selection policies on a backend whose memory the host cannot read (a GPU; here a CPU
// backend that presents itself as one): the model hands them float32 copies of the queries,
// keys and speculated queries, so InfiniGen and the window run over that backend's resident
// cache and over the store with the CPU backend's logits bit for bit, and never see a device
// pointer. Policies that read stored K rows themselves are refused, naming what would work.
TEST_P(StoreCache, HostPoliciesRunOnABackendTheHostCannotRead) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  Model& on_device = *loaded;
  const auto prompts = Prompts(2);
  for (const std::string name : {"infinigen", "window"}) {
    SCOPED_TRACE(name);
    auto a = Policy(name), b = Policy(name);
    BackendKvCache resident(*l_.backend, l_.model->kv_shape());
    const DecodeRun want = Decode(*l_.model, resident, {a.get(), b.get()}, prompts, 10, 1000);
    BackendKvCache device_resident(device, on_device.kv_shape());
    StoreKvCache device_store(device, on_device.kv_shape(), *client_, DeviceStoreOptions());
    for (KvCache* cache : std::vector<KvCache*>{&device_resident, &device_store}) {
      SCOPED_TRACE(cache == &device_resident ? "resident on the device" : "over the store");
      auto c = Policy(name), d = Policy(name);
      HostPointerCheck checked_c(*c, device), checked_d(*d, device);
      const DecodeRun got = Decode(on_device, *cache, {&checked_c, &checked_d}, prompts, 10, 1000);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.logits, want.logits);
      EXPECT_EQ(checked_c.device_pointers() + checked_d.device_pointers(), 0);
      EXPECT_GT(checked_c.sparse_selections(), 0);
      EXPECT_GT(checked_d.sparse_selections(), 0);
      // What a GPU waits for per decode layer of this batch of 2 (the fixture has 2 layers):
      // the layer's queries, keys and speculated queries for the policies, in one copy (1); the
      // logits once per step (0.5); over the store also the speculated queries for the next
      // layer's prefetch (1), while the batch's new K/V rows arrive with one of those
      // (Backend::CopyToHostLater). Each wait stalls the host until the device drains
      // (measured on an H200: docs/benchmarks.md); the target is none. Before one copy
      // carried several views: 6 and 11 per layer; before the rows came along: 3.5.
      ASSERT_GT(got.profile.layers, 0);
      const double syncs = static_cast<double>(got.profile.backend.synchronizations) /
                           static_cast<double>(got.profile.layers);
      EXPECT_LE(syncs, cache == &device_store ? 2.5 : 1.5)
          << got.profile.backend.synchronizations << " waits over " << got.profile.layers
          << " decode layers";
    }
  }
  auto h2o = Policy("h2o");
  BackendKvCache device_resident(device, on_device.kv_shape());
  ASSERT_TRUE(device_resident.Open(1, 64).ok());
  std::vector<float> logits(on_device.config().vocab_size);
  ForwardChunk c{1, 0, prompts[0], false, h2o.get()};
  auto st = DecodeStep(on_device, device_resident).Forward({&c, 1}, logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("in host memory"), std::string::npos) << st;
}

// InfiniGen choosing in the memory of a backend the host cannot read (what it does on a GPU):
// its partial keys live there and Backend::ChooseRows picks the rows, of which the host reads
// back only the chosen indices (no query, key or speculated query is copied out). The CPU
// backend's ChooseRows is the host policy's arithmetic, so the tokens and logits equal the host
// policy's bit for bit, over the device's resident cache and over the store.
TEST_P(StoreCache, InfinigenChoosesRowsOnABackendTheHostCannotRead) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  Model& on_device = *loaded;
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const auto prompts = Prompts(2);
  auto a = Policy("infinigen"), b = Policy("infinigen");
  ASSERT_FALSE(a->chooses_on_backend());
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  // Prompts prefilled in chunks of 8: the store path reads every stored row back for each
  // chunk (ReadAll, gathered by the device where it reads the store's memory).
  const DecodeRun want = Decode(*l_.model, resident, {a.get(), b.get()}, prompts, 10, 8);
  BackendKvCache device_resident(device, on_device.kv_shape());
  StoreKvCache device_store(device, on_device.kv_shape(), *client_, DeviceStoreOptions());
  for (KvCache* cache : std::vector<KvCache*>{&device_resident, &device_store}) {
    SCOPED_TRACE(cache == &device_resident ? "resident on the device" : "over the store");
    auto c = Policy("infinigen", *skew), d = Policy("infinigen", *skew);
    ASSERT_TRUE(c->chooses_on_backend());
    const int64_t sparse_before = device.sparse_choices();
    const int64_t gathered_before = device.rows_gathered();
    const DecodeRun got = Decode(on_device, *cache, {c.get(), d.get()}, prompts, 10, 8);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
    EXPECT_GT(device.sparse_choices(), sparse_before);  // it chose, not every row
    if (cache == &device_store && std::get<1>(GetParam())) {
      EXPECT_GT(device.rows_gathered(), gathered_before) << "the device gathers the store's rows";
    }
    // Waits per decode layer of this batch of 2 (2 layers): one, which brings the layer's
    // choices (one copy for both sequences) and, over the store, the batch's new K/V rows and
    // the next layer's prefetch choices with them (Backend::CopyToHostLater: three waits per
    // layer before); and the logits once per step (0.5). What the host policies wait for is
    // bounded in HostPoliciesRunOnABackendTheHostCannotRead; the difference is what crosses:
    // indices, not the layer's activations.
    ASSERT_GT(got.profile.layers, 0);
    const double syncs = static_cast<double>(got.profile.backend.synchronizations) /
                         static_cast<double>(got.profile.layers);
    EXPECT_LE(syncs, 1.5);
  }
}

// What a device waits for per decode layer does not grow with the batch (and what it is sent
// grows by a sequence's slot list, or its rows where they are copied): the layer's new K/V
// rows of every sequence leave the device in one copy (KvCache::AppendLayer), as the choices
// do, and all of them arrive at one wait with the next layer's prefetch choices: 1 per layer,
// plus the logits' 0.5 on this 2-layer fixture. On an H200 the waits were 2.9 per layer at
// batch 1 and 9.9 at batch 16 when each sequence's rows left on their own (docs/benchmarks.md,
// lease D), 2.9 at batches 1 and 8 with one copy for the batch (lease E).
TEST_P(StoreCache, DeviceWaitsPerLayerDoNotGrowWithTheBatch) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  std::vector<double> waits, copies;
  for (size_t batch : {1u, 2u, 5u}) {
    SCOPED_TRACE(absl::StrCat("batch ", batch));
    StoreKvCache store(device, loaded->kv_shape(), *client_, DeviceStoreOptions());
    std::vector<std::unique_ptr<KvSelectionPolicy>> owned;
    std::vector<KvSelectionPolicy*> policies;
    for (size_t i = 0; i < batch; ++i) {
      owned.push_back(Policy("infinigen", *skew));
      policies.push_back(owned.back().get());
    }
    const DecodeRun got = Decode(*loaded, store, policies, Prompts(batch), 6, 1000);
    ASSERT_GT(got.profile.layers, 0);
    waits.push_back(static_cast<double>(got.profile.backend.synchronizations) /
                    static_cast<double>(got.profile.layers));
    copies.push_back(static_cast<double>(got.profile.backend.copies_to_device) /
                     static_cast<double>(got.profile.layers));
  }
  EXPECT_LE(waits[0], 1.5);
  EXPECT_DOUBLE_EQ(waits[1], waits[0]);
  EXPECT_DOUBLE_EQ(waits[2], waits[0]);
  // Copies to the device per layer and extra sequence: where the device gathers by block
  // table, its slot list only (4.2, 5.3, 8.8 at batches 1, 2, 5; the batch's index maps go in
  // one copy, block tables at new blocks only); where rows are copied (a transport that maps
  // nothing), its K and V rows too (5, 7, 13). Lease G measured 2.9 per sequence on an H200 (two
  // row-address tables and an index map).
  const double per_sequence = (copies[2] - copies[0]) / 4;
  EXPECT_LE(per_sequence, std::get<1>(GetParam()) ? 1.25 : 2.25) << copies[0] << " at batch 1";
}

// InfiniGen's dense layers kept on the device as well (StoreKvCacheOptions::
// device_resident_layers; the fixture's one dense layer): the same tokens and logits bit for bit
// as reading them from the store, with chunked prefill (reads of every stored row) and decode
// (the dense layer's every-row prefetch), and those reads move nothing over the link: the bytes
// fetched fall by the dense layer's share and the device gathers fewer rows from the store.
TEST_P(StoreCache, DenseLayersKeptOnTheDeviceGiveTheSameLogitsAndMoveNoBytes) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const auto prompts = Prompts(2);
  DecodeRun runs[2];
  int64_t gathered[2];
  for (int resident : {0, 1}) {
    SCOPED_TRACE(absl::StrCat(resident, " layers on the device"));
    StoreKvCacheOptions options = DeviceStoreOptions();
    options.device_resident_layers = resident;
    StoreKvCache store(device, loaded->kv_shape(), *client_, options);
    auto a = Policy("infinigen", *skew), b = Policy("infinigen", *skew);
    const int64_t gathered_before = device.rows_gathered();
    runs[resident] = Decode(*loaded, store, {a.get(), b.get()}, prompts, 10, 8);
    gathered[resident] = device.rows_gathered() - gathered_before;
    EXPECT_GT(runs[resident].prefetch_hits, 0);
    EXPECT_EQ(runs[resident].prefetch_misses, 0);
  }
  EXPECT_EQ(runs[1].tokens, runs[0].tokens);
  EXPECT_EQ(runs[1].logits, runs[0].logits);
  // Layer 0 reads every row each step (~30-rows sequences); layer 1 a 30% budget of them.
  EXPECT_GT(runs[0].bytes_fetched, 0);
  EXPECT_LT(runs[1].bytes_fetched, runs[0].bytes_fetched / 2);
  if (std::get<1>(GetParam())) {
    EXPECT_LT(gathered[1], gathered[0] / 2);
  }
  // A sequence gone idle (a kept conversation) gives its device copy back: its dense reads
  // then gather from the store.
  if (std::get<1>(GetParam())) {
    StoreKvCacheOptions resident = DeviceStoreOptions();
    resident.device_resident_layers = 1;
    StoreKvCache store(device, loaded->kv_shape(), *client_, resident);
    ASSERT_TRUE(store.Open(1, 64).ok());
    std::vector<float> logits(loaded->config().vocab_size);
    ForwardChunk c{1, 0, prompts[0], false, nullptr};
    ASSERT_TRUE(DecodeStep(*loaded, store).Forward({&c, 1}, logits).ok());
    const int64_t rows = static_cast<int64_t>(prompts[0].size());
    std::vector<int32_t> every(static_cast<size_t>(loaded->config().num_kv_heads * rows));
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int32_t>(i % rows);
    for (bool idle : {false, true}) {
      if (idle) store.Idle(1);
      const int64_t before = device.rows_gathered();
      ASSERT_TRUE(store.Prefetch(1, 0, every.data(), rows).ok());
      ASSERT_TRUE(store.Fetch(1, 0).ok());
      EXPECT_EQ(device.rows_gathered() > before, idle);
    }
    store.Close(1);
  }
  // On a backend whose memory the host reads (the CPU) nothing is kept twice, nor in a KV pool.
  StoreKvCacheOptions options;
  options.device_resident_layers = 1;
  EXPECT_EQ(StoreKvCache(device, loaded->kv_shape(), *client_, options).device_resident_layers(),
            1);
  EXPECT_EQ(
      StoreKvCache(*l_.backend, l_.model->kv_shape(), *client_, options).device_resident_layers(),
      0);
  options.pool = KvPoolConfig();
  EXPECT_EQ(StoreKvCache(device, loaded->kv_shape(), *client_, options).device_resident_layers(),
            0);
}

// A sequence whose staging or resident layers the device cannot hold is not left half open:
// Open fails RESOURCE_EXHAUSTED (the engine waits and retries), and the same sequence opens
// later, smaller, in the cache and in the store. What it then holds on the device is what
// admission counts for it (BackendBytesFor), to the byte.
TEST_P(StoreCache, AnOpenTheDeviceCannotHoldLeavesNothingOpen) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  StoreKvCacheOptions options = DeviceStoreOptions();
  options.device_resident_layers = 1;
  StoreKvCache cache(device, loaded->kv_shape(), *client_, options);
  // Six buffers of about the capacity's rows each: staging K and V of two layers in flight,
  // and the resident layer's K and V.
  device.FailAllocationsOver(cache.BackendBytesFor(200) / 12);
  const size_t before = device.live_bytes();
  const absl::Status st = cache.Open(7, 200);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_FALSE(cache.Length(7).ok());
  EXPECT_EQ(device.live_bytes(), before);
  ASSERT_TRUE(cache.Open(7, 50).ok());
  EXPECT_EQ(device.live_bytes() - before, cache.BackendBytesFor(50));
  // Host bounce buffers only where rows are copied to the device (the same size as its
  // staging); none where the device gathers the store's rows by address.
  const size_t staging =
      cache.BackendBytesFor(50) - ResidentLayers::BytesPerToken(loaded->kv_shape(), 1) * 50;
  EXPECT_EQ(cache.HostStagingBytes(), cache.device_gathers() ? 0 : staging);
  EXPECT_LE(cache.HostStagingBytes(), cache.HostBytesFor(50));
  cache.Close(7);
}

TEST_P(StoreCache, PoliciesThatReadStoredKeysAreRefused) {
  auto h2o = Policy("h2o");
  ASSERT_TRUE(cache_->Open(1, 64).ok());
  const auto prompt = Prompts(1)[0];
  std::vector<float> logits(l_.model->config().vocab_size);
  ForwardChunk c{1, 0, prompt, false, h2o.get()};
  auto st = DecodeStep(*l_.model, *cache_).Forward({&c, 1}, logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("resident"), std::string::npos) << st;
  cache_->Close(1);
}

INSTANTIATE_TEST_SUITE_P(TinyModels, StoreCache, testing::StoreCacheParams(),
                         testing::StoreCacheParamName);

}  // namespace
}  // namespace infinigen
