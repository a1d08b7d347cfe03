// Rows planned on the device (StoreKvCacheOptions::plan_on_device; docs/worker.md, "Rows
// planned on the device"), on the tiny fixtures over the device-like CPU backend: the decode
// step hands the choices to the cache where the backend made them, so a step of decodes waits
// once (for its logits) and a prompt chunk beside them adds only its own waits; tokens and
// logits are the resident cache's bit for bit and as many rows move as with the host's
// bookkeeping; choices outside the prefetch are gathered, or fail their chunk alone.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"
#include "gpu_worker/backend/cpu_backend.h"
#include "gpu_worker/engine/decode_step.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/store_cache_fixture.h"

namespace infinigen {
namespace {

using testing::Decode;
using testing::DecodeRun;
using testing::DeviceLikeCpuBackend;
using testing::Mixed;
using testing::MixedRun;
using testing::RandomTokens;
using testing::SmallBlocks;
using StoreCache = testing::StoreCacheTest;

// Rows planned on the device (StoreKvCacheOptions::plan_on_device): the decode step hands the
// choices to the cache where the backend made them, the attention reads their counts there and
// the appends wait for the step's end, so a decode step waits once (for its logits), not once a
// layer; the tokens and logits are the resident cache's bit for bit, and as many rows move as
// with the host's bookkeeping (the same plan), far fewer than without reuse. With the default
// blocks and with 4-row blocks (the device's block tables brought up to date as the sequences
// grow, asked for apart from any gather).
TEST_P(StoreCache, RowsPlannedOnTheDeviceChangeNoBitAndNoLayerWaits) {
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  auto skew = UploadPartialSkew(sidecar_, device);
  ASSERT_TRUE(skew.ok()) << skew.status();
  const KvCacheShape shape = loaded->kv_shape();
  SmallBlocks small(shape);
  ASSERT_NE(small.client, nullptr);
  const auto prompts = Prompts(3);
  BackendKvCache resident(*l_.backend, l_.model->kv_shape());
  auto a = Policy("infinigen"), b = Policy("infinigen"), c = Policy("infinigen");
  const DecodeRun want = Decode(*l_.model, resident, {a.get(), b.get(), c.get()}, prompts, 16, 8);
  for (KvStoreClient* client : {client_.get(), small.client.get()}) {
    SCOPED_TRACE(client == client_.get() ? "default blocks" : "4-row blocks");
    int64_t table_waits = 0;  // the last run's
    auto run = [&](bool reuse, bool plan) {
      SCOPED_TRACE(
          absl::StrCat(reuse ? "reuse" : "no reuse", plan ? ", planned on the device" : ""));
      StoreKvCacheOptions options = DeviceStoreOptions();
      if (reuse) options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
      options.plan_on_device = plan;
      StoreKvCache cache(device, shape, *client, options);
      std::vector<std::unique_ptr<KvSelectionPolicy>> p;
      for (int i = 0; i < 3; ++i) p.push_back(Policy("infinigen", *skew));
      device.ResetMostGathersJoined();
      DecodeRun got = Decode(*loaded, cache, {p[0].get(), p[1].get(), p[2].get()}, prompts, 16, 8);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.logits, want.logits);
      EXPECT_EQ(got.prefetch_misses, 0);
      // A join runs one layer's gathers (K and V of each sequence) at most, never the next
      // layer's too: those overlap the layer being attended.
      EXPECT_LE(device.most_gathers_joined(), 3 * 2);
      table_waits = cache.table_waits();
      return got;
    };
    const DecodeRun plain = run(false, false), host = run(true, false), planned = run(true, true);
    const StepProfile& pp = planned.profile;
    ASSERT_EQ(pp.steps, 16);
    if (std::get<1>(GetParam())) {  // the GPU gathers by block table: planned there
      EXPECT_EQ(pp.backend.synchronizations, pp.steps) << "one wait a step: the logits'";
      EXPECT_GE(host.profile.backend.synchronizations, host.profile.layers)
          << "the host's bookkeeping waits once a layer";
      EXPECT_EQ(planned.bytes_fetched, host.bytes_fetched) << "the same rows move";
      EXPECT_EQ(planned.bytes_reused, host.bytes_reused) << "and the same stay";
      EXPECT_GT(planned.bytes_reused, 0);
      EXPECT_LT(2 * planned.bytes_fetched, plain.bytes_fetched);
      EXPECT_GT(planned.prefetch_hits, 0);
      // The store asked for the rows the step before appended once a step, for the 3 sequences
      // together (asked a sequence at a time, 48 calls).
      EXPECT_EQ(table_waits, pp.steps) << "3 sequences asked for apart";
    } else {  // rows copied by the transport: nothing to plan there
      EXPECT_EQ(pp.backend.synchronizations, host.profile.backend.synchronizations);
      EXPECT_EQ(planned.bytes_fetched, host.bytes_fetched);
    }
  }
}

// A policy choosing in backend memory whose layer's own choice lies outside what it prefetched:
// it prefetches slots 0 .. p-1 of every head and then chooses p .. p+m-1 and the current token
// (every row while a sequence is shorter than p + m + 1), so that every chosen row but the
// current one is a miss. Its choices are written with copies to the backend (a fake of the choice,
// to test the rows planned around it).
class SplitChoicePolicy final : public KvSelectionPolicy {
 public:
  SplitChoicePolicy(Backend& backend, int kv_heads, int64_t p, int64_t m)
      : backend_(backend), kv_heads_(kv_heads), p_(p), m_(m) {}
  std::string Name() const override { return "split-choice"; }
  SpeculationInput speculation_input() const override { return SpeculationInput::kPreviousNorm; }
  bool SpeculatesFor(int layer) const override { return layer >= 1; }
  bool chooses_on_backend() const override { return true; }
  int64_t BackendChoiceCapacity(int64_t rows) const override {
    return std::min<int64_t>(rows + 1, std::max(p_, m_ + 1));
  }
  absl::Status Select(const SelectRequest&, Selection&) override {
    return absl::InternalError("chooses on the backend");
  }
  absl::Status OnBackendKeys(SequenceId, int, MatView, int64_t) override {
    return absl::OkStatus();  // it keeps no keys
  }
  absl::StatusOr<BackendChoiceResult> ChooseOnBackend(const BackendChoice& c) override {
    if (c.layer < 1 || c.rows < p_ + m_ + 1) return BackendChoiceResult::kAll;
    std::vector<int32_t> lists(static_cast<size_t>(kv_heads_ * c.index_capacity), 0);
    const int64_t n = c.prefetch ? p_ : m_ + 1;
    for (int g = 0; g < kv_heads_; ++g) {
      for (int64_t j = 0; j < n; ++j) {
        lists[g * c.index_capacity + j] = static_cast<int32_t>(c.prefetch ? j : p_ + j);
      }
      if (!c.prefetch) lists[g * c.index_capacity + m_] = static_cast<int32_t>(c.rows - 1);
    }
    const int32_t count = static_cast<int32_t>(n);
    IG_RETURN_IF_ERROR(backend_.CopyToDevice(&count, c.count, sizeof(count)));
    IG_RETURN_IF_ERROR(
        backend_.CopyToDevice(lists.data(), c.indices, lists.size() * sizeof(int32_t)));
    return BackendChoiceResult::kLaunched;
  }

 private:
  Backend& backend_;
  const int kv_heads_;
  const int64_t p_, m_;
};

// Choices whose rows were not prefetched, planned on the device: gathered into rows of their
// own (at most StoreKvCache::kMissRows a head), the resident cache's logits bit for bit; a
// choice past that room fails its chunk alone (INTERNAL), its held appends never reach the
// store (its length stays where the step found it), and the other chunk of the step is exact.
TEST_P(StoreCache, ChoicesOutsideThePrefetchPlannedOnTheDeviceAreGatheredOrFailTheirChunk) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "rows copied: nothing is planned on the device";
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  ASSERT_NE(loaded, nullptr);
  const int kv_heads = loaded->config().num_kv_heads;
  StoreKvCacheOptions options = DeviceStoreOptions();
  options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
  options.plan_on_device = true;
  {
    SplitChoicePolicy cpu_a(*l_.backend, kv_heads, 8, 6), cpu_b(*l_.backend, kv_heads, 8, 6);
    BackendKvCache resident(*l_.backend, l_.model->kv_shape());
    const auto prompts = Prompts(2);
    const DecodeRun want = Decode(*l_.model, resident, {&cpu_a, &cpu_b}, prompts, 8, 8);
    SplitChoicePolicy a(device, kv_heads, 8, 6), b(device, kv_heads, 8, 6);
    StoreKvCache cache(device, loaded->kv_shape(), *client_, options);
    const DecodeRun got = Decode(*loaded, cache, {&a, &b}, prompts, 8, 8);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.logits, want.logits);
    EXPECT_EQ(got.profile.backend.synchronizations, got.profile.steps) << "planned on the device";
  }
  // 70 misses a head: past the room for them.
  const int64_t m = StoreKvCache::kMissRows + 6;
  StoreKvCache cache(device, loaded->kv_shape(), *client_, options);
  SplitChoicePolicy wide(device, kv_heads, 8, m), narrow(device, kv_heads, 8, 6);
  const auto long_prompt = RandomTokens(8 + m + 10, loaded->config().vocab_size, 4);
  const auto short_prompt = Prompts(1)[0];
  const int64_t vocab = loaded->config().vocab_size;
  std::vector<float> logits(2 * vocab);
  DecodeStep step(*loaded, cache);
  ASSERT_TRUE(cache.Open(1, 256).ok());
  ASSERT_TRUE(cache.Open(2, 256).ok());
  for (auto [seq, prompt, policy] :
       {std::tuple{SequenceId{1}, &long_prompt, static_cast<KvSelectionPolicy*>(&wide)},
        std::tuple{SequenceId{2}, &short_prompt, static_cast<KvSelectionPolicy*>(&narrow)}}) {
    ForwardChunk c{seq, 0, *prompt, false, policy};
    ASSERT_TRUE(step.Forward({&c, 1}, std::span<float>(logits).first(vocab)).ok());
  }
  const int32_t token[2] = {5, 7};
  const int64_t long_len = static_cast<int64_t>(long_prompt.size());
  const int64_t short_len = static_cast<int64_t>(short_prompt.size());
  const ForwardChunk batch[2] = {{1, long_len, {&token[0], 1}, false, &wide},
                                 {2, short_len, {&token[1], 1}, false, &narrow}};
  const absl::Status st = step.Forward(batch, logits);
  EXPECT_TRUE(absl::IsInternal(st)) << st;
  EXPECT_TRUE(absl::IsInternal(step.chunk_status(0))) << step.chunk_status(0);
  EXPECT_TRUE(step.chunk_status(1).ok()) << step.chunk_status(1);
  for (int layer = 0; layer < loaded->config().num_layers; ++layer) {
    EXPECT_EQ(cache.NumSlots(1, layer).value_or(-1), long_len) << "layer " << layer;
    EXPECT_EQ(cache.NumSlots(2, layer).value_or(-1), short_len + 1) << "layer " << layer;
  }
  // The other sequence's logits are what it gets alone.
  std::vector<float> alone(vocab);
  {
    options.id_base = 5000;  // beside `cache`'s sequences in the same store
    StoreKvCache other(device, loaded->kv_shape(), *client_, options);
    SplitChoicePolicy p(device, kv_heads, 8, 6);
    DecodeStep s(*loaded, other);
    ASSERT_TRUE(other.Open(2, 256).ok());
    ForwardChunk c{2, 0, short_prompt, false, &p};
    ASSERT_TRUE(s.Forward({&c, 1}, alone).ok());
    const ForwardChunk d{2, short_len, {&token[1], 1}, false, &p};
    ASSERT_TRUE(s.Forward({&d, 1}, alone).ok());
  }
  EXPECT_EQ(std::vector<float>(logits.begin() + vocab, logits.end()), alone);
  cache.Close(1);
  cache.Close(2);
}

// The rows the step before appended are asked for once a step, every decode of the step planned
// on the device together (StoreKvCache::TablesFor): when the store has lost one of them, that
// call fails and the step's sequences each ask alone (not together again), so that the lost
// sequence fails its chunk alone (ABORTED: the store does not know it) and the others' logits
// are those of the same step with nothing lost.
TEST_P(StoreCache, ASequenceTheStoreLostFailsAloneWhenTheStepAsksForAll) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "rows copied: nothing is planned on the device";
  DeviceLikeCpuBackend device;
  std::unique_ptr<Model> loaded = OnDevice(device);
  const std::shared_ptr<const PartialSkewOnBackend> skew = SkewOn(device);
  ASSERT_TRUE(loaded != nullptr && skew != nullptr);
  constexpr int kSeqs = 3;
  const auto prompts = Prompts(kSeqs);
  const int64_t vocab = loaded->config().vocab_size;
  // Three sequences prefilled and decoded 3 steps (the third with sequence 2 lost first if
  // `lose`); the third step's logits, its chunks' statuses and the store's table waits in it.
  struct Last {
    std::vector<float> logits;
    absl::Status status[kSeqs];
    int64_t table_waits = 0;
  };
  auto run = [&](bool lose, uint64_t id_base) {
    StoreKvCacheOptions options = DeviceStoreOptions();
    options.id_base = id_base;
    options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
    options.plan_on_device = true;
    StoreKvCache cache(device, loaded->kv_shape(), *client_, options);
    std::vector<std::unique_ptr<KvSelectionPolicy>> p;
    DecodeStep step(*loaded, cache);
    Last last;
    last.logits.resize(kSeqs * vocab);
    for (SequenceId seq = 1; seq <= kSeqs; ++seq) {
      p.push_back(Policy("infinigen", skew));
      EXPECT_TRUE(cache.Open(seq, 256).ok());
      p.back()->Open(seq, 256);
      const ForwardChunk c{seq, 0, prompts[seq - 1], false, p.back().get()};
      EXPECT_TRUE(step.Forward({&c, 1}, std::span<float>(last.logits).first(vocab)).ok());
    }
    const int32_t tokens[3] = {5, 7, 9};
    for (int t = 0; t < 3; ++t) {
      std::vector<ForwardChunk> batch;
      for (SequenceId seq = 1; seq <= kSeqs; ++seq) {
        batch.push_back({seq, static_cast<int64_t>(prompts[seq - 1].size()) + t,
                         std::span<const int32_t>(&tokens[t], 1), false, p[seq - 1].get()});
      }
      if (t == 2 && lose) EXPECT_TRUE(client_->Close(cache.StoreId(2)).ok());
      const int64_t before = cache.table_waits();
      const absl::Status st = step.Forward(batch, last.logits);
      last.table_waits = cache.table_waits() - before;
      for (int b = 0; b < kSeqs; ++b) last.status[b] = step.chunk_status(b);
      if (t < 2) EXPECT_TRUE(st.ok()) << st;
    }
    for (SequenceId seq = 1; seq <= kSeqs; ++seq) {
      cache.Close(seq);
      p[seq - 1]->Release(seq);
    }
    return last;
  };
  const Last kept = run(false, 3000), lost = run(true, 4000);
  for (int b = 0; b < kSeqs; ++b) EXPECT_TRUE(kept.status[b].ok()) << kept.status[b];
  EXPECT_EQ(kept.table_waits, 1) << "the 3 sequences asked for in one call";
  EXPECT_TRUE(lost.status[0].ok()) << lost.status[0];
  EXPECT_TRUE(absl::IsAborted(lost.status[1])) << lost.status[1];
  EXPECT_THAT(lost.status[1].message(), ::testing::HasSubstr("unknown sequence 4002"));
  EXPECT_TRUE(lost.status[2].ok()) << lost.status[2];
  EXPECT_EQ(lost.table_waits, 1 + kSeqs) << "together (refused), then each alone";
  for (int b : {0, 2}) {
    SCOPED_TRACE(absl::StrCat("sequence ", b + 1));
    EXPECT_EQ(
        std::vector<float>(lost.logits.begin() + b * vocab, lost.logits.begin() + (b + 1) * vocab),
        std::vector<float>(kept.logits.begin() + b * vocab, kept.logits.begin() + (b + 1) * vocab));
  }
}

// A prompt prefilled in chunks beside decoding sequences (the engine's steps while a long
// prompt arrives), rows planned on the device: the decode tokens of each mixed step are still
// planned there and the prompt chunk's appends are held with theirs, its attention reading the
// rows stored before it and its own from the activations, so that a mixed step waits once (for
// its logits) as a step of decodes alone does, where the host's bookkeeping waits at least once
// a layer, also with the dense layer's rows kept on the device; tokens and logits (the prompt's
// last chunk's included) are the resident cache's bit
// for bit, and as many bytes move as with the host's bookkeeping but for the prompt chunks' own
// rows, which that path reads back from the store.
TEST_P(StoreCache, DecodesBesideAPromptChunkArePlannedOnTheDeviceToo) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "rows copied: nothing is planned on the device";
  // K/V stored as the activations are (f32) and in bf16: then even a first chunk's rows are
  // read back converted, not taken from the activations.
  for (DType kv : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(absl::StrCat("K/V in ", DTypeName(kv)));
    CpuBackendOptions backend_options;
    backend_options.kv_dtype = kv;
    CpuBackend host_backend(backend_options);
    DeviceLikeCpuBackend device(backend_options);
    auto reference = Model::Load(*l_.ckpt, host_backend);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ASSERT_TRUE(AttachSidecar(**reference, *l_.ckpt, sidecar_).ok());
    std::unique_ptr<Model> loaded = OnDevice(device);
    ASSERT_NE(loaded, nullptr);
    auto skew = UploadPartialSkew(sidecar_, device);
    ASSERT_TRUE(skew.ok()) << skew.status();
    std::vector<std::vector<int32_t>> prompts = Prompts(2);
    prompts.push_back(RandomTokens(44, loaded->config().vocab_size, 9));  // 5 x 8 + 4
    const int64_t steps = 12, layers = loaded->config().num_layers;
    BackendKvCache resident(host_backend, (*reference)->kv_shape());
    auto a = Policy("infinigen"), b = Policy("infinigen"), c = Policy("infinigen");
    const MixedRun want = Mixed(**reference, resident, {a.get(), b.get(), c.get()}, prompts, steps);
    auto run = [&](bool plan, int resident_layers, int64_t n) {
      SCOPED_TRACE(absl::StrCat(plan ? "planned on the device" : "the host's plan", ", ",
                                resident_layers, " dense layer(s) kept on the device"));
      StoreKvCacheOptions options = DeviceStoreOptions();
      options.reuse_rows = [](int64_t capacity) { return capacity + 1; };
      options.plan_on_device = plan;
      options.device_resident_layers = resident_layers;
      StoreKvCache cache(device, loaded->kv_shape(), *client_, options);
      std::vector<std::unique_ptr<KvSelectionPolicy>> p;
      for (int i = 0; i < 3; ++i) p.push_back(Policy("infinigen", *skew));
      device.ResetMostGathersJoined();
      MixedRun got = Mixed(*loaded, cache, {p[0].get(), p[1].get(), p[2].get()}, prompts, n);
      if (n == steps) {
        EXPECT_EQ(got.tokens, want.tokens);
        EXPECT_EQ(got.logits, want.logits);
      }
      return got;
    };
    const MixedRun host = run(false, 0, steps), planned = run(true, 0, steps);
    // The dense layer's rows before a prompt chunk copied inside the device instead.
    const MixedRun dense_kept = run(true, 1, steps);
    // In the 6 mixed steps alone: the prompt chunk's rows before it move with the two decodes'
    // on the side queue (prefetched during the layer before), one layer's gathers at a time, K
    // and V of the 3 sequences (4 if the chunk read them at its layer).
    run(true, 0, 6);
    EXPECT_EQ(device.most_gathers_joined(), 3 * 2);
    EXPECT_LT(dense_kept.bytes_fetched, planned.bytes_fetched);
    ASSERT_EQ(planned.waits.size(), static_cast<size_t>(steps));
    ASSERT_EQ(host.waits.size(), static_cast<size_t>(steps));
    int64_t mixed = 0;
    for (int64_t s = 0; s < steps; ++s) {
      SCOPED_TRACE(absl::StrCat("step ", s, planned.mixed[s] ? " (a prompt chunk in it)" : ""));
      mixed += planned.mixed[s];
      EXPECT_EQ(planned.waits[s], 1) << "the logits' wait alone";
      EXPECT_EQ(dense_kept.waits[s], 1);
      EXPECT_GE(host.waits[s], layers) << "the host's bookkeeping waits once a layer";
    }
    EXPECT_EQ(mixed, 6);
    // The same rows move but for the prompt's own: a chunk's read back from the store with those
    // before it on the host's path (5 chunks past the first, and the first too where its rows
    // are converted: 36 or 44 rows of every layer and head).
    const KvCacheShape shape = loaded->kv_shape();
    const int64_t own = 2 * layers * shape.num_kv_heads * (kv == DType::kF32 ? 36 : 44) *
                        static_cast<int64_t>(shape.head_dim * DTypeSize(shape.dtype));
    EXPECT_EQ(planned.bytes_fetched, host.bytes_fetched - own) << "the same rows move";
    EXPECT_EQ(planned.bytes_reused, host.bytes_reused) << "and the same stay";
    EXPECT_GT(planned.bytes_reused, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(TinyModels, StoreCache, testing::StoreCacheParams(),
                         testing::StoreCacheParamName);

}  // namespace
}  // namespace infinigen
