// Admission that matches memory (issue 22, item 10): the engine admits sequences against a
// device-memory limit, and what the backend really holds for them never passes it. The backend
// is a GPU's path run on the CPU (memory the host cannot read; it counts every allocation's
// bytes and their high-water mark); the sequences run InfiniGen over the KV store with their
// dense layer resident on the device, so that each holds staging, resident K/V, partial keys
// and the choices' workspace there. Two long conversations fill the limit and are kept as
// sessions (idle: their stagings become spares), then short requests arrive together and fill
// it again, then a conversation continues. The backend's high-water mark above what it held
// before (weights, the model's workspaces at their size) must stay within the limit plus the
// workspaces the run grew. Fails without either fix it was written for: idle sessions that kept
// their staging, or spares that admission did not count.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/infinigen/infinigen_policy.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "tests/support/device_like_backend.h"
#include "tests/support/fixture_model.h"
#include "tests/support/in_process_store.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

struct Done {
  absl::Notification done;
  absl::Mutex mu;
  std::vector<int32_t> tokens;
  absl::Status status;
  EventSink Sink() {
    return [this](const EngineEvent& e) {
      {
        absl::MutexLock l(&mu);
        if (e.token >= 0) tokens.push_back(e.token);
        if (e.done) status = e.status;
      }
      if (e.done) done.Notify();
    };
  }
};

class DeviceAdmission : public ::testing::Test {
 protected:
  void SetUp() override {
    ckpt_ = *Checkpoint::Open(testing::FixturePath("hf/llama31_gqa"));
    auto model = Model::Load(*ckpt_, backend_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    PrepareOptions po;
    po.ratio = 0.5f;
    po.chunk_tokens = 40;
    auto sidecar = PrepareInfinigen(*model_, *ckpt_,
                                    testing::RandomTokens(96, model_->config().vocab_size, 5), po);
    ASSERT_TRUE(sidecar.ok()) << sidecar.status();
    sidecar_ = std::move(*sidecar);
    ASSERT_TRUE(AttachSidecar(*model_, *ckpt_, sidecar_).ok());
    auto skew = UploadPartialSkew(sidecar_, backend_);
    ASSERT_TRUE(skew.ok()) << skew.status();
    skew_ = *skew;
    selection_.policy = PolicyKind::kInfinigen;
    selection_.dense_layers = 1;
    selection_.budget_fraction = 0.3;
    cache_options_.device_reads_mapped_rows = true;
    cache_options_.device_resident_layers = 1;
  }

  std::unique_ptr<KvSelectionPolicy> Policy() {
    auto p = MakeSelectionPolicy(selection_, model_->config(), &sidecar_, skew_);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  EngineRequest Request(int64_t prompt, int64_t new_tokens, unsigned seed,
                        std::string session = "") {
    EngineRequest r;
    r.prompt = testing::RandomTokens(prompt, model_->config().vocab_size, seed);
    r.options.max_new_tokens = new_tokens;
    r.options.ignore_eos = true;
    r.session_id = std::move(session);
    r.policy = Policy();
    return r;
  }

  // Submits every request at once and waits for all of them; each must succeed.
  void RunAll(BatchEngine& engine, std::vector<EngineRequest> requests,
              std::vector<std::vector<int32_t>>* tokens = nullptr) {
    std::vector<std::unique_ptr<Done>> done;
    for (EngineRequest& r : requests) {
      done.push_back(std::make_unique<Done>());
      auto id = engine.Submit(std::move(r), done.back()->Sink());
      ASSERT_TRUE(id.ok()) << id.status();
    }
    for (auto& d : done) {
      ASSERT_TRUE(d->done.WaitForNotificationWithTimeout(absl::Seconds(60)));
      absl::MutexLock l(&d->mu);
      EXPECT_TRUE(d->status.ok()) << d->status;
      if (tokens != nullptr) tokens->push_back(d->tokens);
    }
  }

  testing::DeviceLikeCpuBackend backend_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<Model> model_;
  InfinigenSidecar sidecar_;
  std::shared_ptr<const PartialSkewOnBackend> skew_;
  SelectionConfig selection_;
  StoreKvCacheOptions cache_options_;
  testing::InProcessStore store_;
};

constexpr int64_t kLongPrompt = 180, kLongNew = 60;  // 240 of the fixture's 256 positions
constexpr int64_t kShortPrompt = 30, kShortNew = 20;

TEST_F(DeviceAdmission, TheBackendsHighWaterMarkStaysWithinTheLimit) {
  ASSERT_NE(store_.client, nullptr);
  EngineConfig config;
  config.max_running = 8;
  {
    // Warm-up without a limit, the same shapes: the model's workspaces reach their sizes.
    StoreKvCache cache(backend_, model_->kv_shape(), *store_.client, cache_options_);
    ASSERT_TRUE(cache.device_gathers());
    ASSERT_EQ(cache.device_resident_layers(), 1);
    BatchEngine engine(*model_, cache, config);
    std::vector<EngineRequest> all;
    for (unsigned i = 0; i < 2; ++i) all.push_back(Request(kLongPrompt, kLongNew, 10 + i));
    for (unsigned i = 0; i < 6; ++i) all.push_back(Request(kShortPrompt, kShortNew, 20 + i));
    RunAll(engine, std::move(all));
  }
  const size_t before = backend_.live_bytes();
  backend_.ResetPeak();

  StoreKvCache cache(backend_, model_->kv_shape(), *store_.client, cache_options_);
  // Room for the two long requests together, as the cache and the policy count them.
  const int64_t long_total = kLongPrompt + kLongNew, short_total = kShortPrompt + kShortNew;
  const size_t long_bytes =
      cache.BackendBytesFor(long_total) + Policy()->BackendBytesFor(long_total);
  const size_t short_bytes =
      cache.BackendBytesFor(short_total) + Policy()->BackendBytesFor(short_total);
  ASSERT_GT(long_bytes, 3 * short_bytes);
  config.device_memory_bytes = 2 * long_bytes;
  size_t live_at_end = 0;
  {
    BatchEngine engine(*model_, cache, config);
    std::vector<std::vector<int32_t>> generated;
    std::vector<EngineRequest> conversations;
    for (unsigned i = 0; i < 2; ++i) {
      conversations.push_back(Request(kLongPrompt, kLongNew, 30 + i, absl::StrCat("s", i)));
    }
    const std::vector<int32_t> first = conversations[0].prompt;
    RunAll(engine, std::move(conversations), &generated);
    ASSERT_EQ(generated.size(), 2u);
    // Kept as sessions, not running: their device memory is free for others.
    std::vector<EngineRequest> shorts;
    for (unsigned i = 0; i < 8; ++i) shorts.push_back(Request(kShortPrompt, kShortNew, 40 + i));
    RunAll(engine, std::move(shorts));
    // The first conversation's next turn takes over its stored KV.
    EngineRequest next = Request(1, 4, 0, "s0");
    next.prompt = first;
    next.prompt.insert(next.prompt.end(), generated[0].begin(), generated[0].end());
    next.prompt.push_back(7);
    next.prompt.push_back(8);
    ASSERT_LE(static_cast<int64_t>(next.prompt.size()) + 4,
              model_->config().max_position_embeddings);
    std::vector<EngineRequest> one;
    one.push_back(std::move(next));
    RunAll(engine, std::move(one));

    // Every request has ended (its last event comes after the engine let its memory go); two
    // conversations stay, idle.
    live_at_end = backend_.live_bytes();
  }
  // Ending the engine closes the conversations, whose stagings join the spares; what it frees
  // is its decode step's workspaces. So the run's workspaces, which admission leaves to the
  // headroom (the decode step's row maps, the cache's packed prefill rows), are what the backend
  // held at the end beyond `before` and those spares: memory an idle sequence held would be in
  // the spares, not here.
  const size_t spares = cache.SpareBackendBytes();
  ASSERT_GE(live_at_end, before + spares);
  const size_t workspaces = live_at_end - before - spares;
  const size_t peak = backend_.peak_bytes() - before;
  std::printf("limit %zu B, long %zu B, short %zu B, peak %zu B, workspaces %zu B\n",
              config.device_memory_bytes, long_bytes, short_bytes, peak, workspaces);
  EXPECT_LE(peak, config.device_memory_bytes + workspaces)
      << "the backend held more than admission allows";
  // The limit was really reached: both long sequences ran at once.
  EXPECT_GE(peak, 2 * long_bytes * 9 / 10);
}

}  // namespace
}  // namespace infinigen
