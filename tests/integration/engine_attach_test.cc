// A stream continued from another worker's KV in the shared store (EngineRequest::attach_home):
// worker A decodes part of a request over the store and dies without closing its sequence;
// worker B's engine takes the rows over (KvCache::Attach, no prefill: the usage says how many
// tokens were kept), rebuilds the policy's state from the stored keys (DecodeStep::Restore) and
// continues with exactly the tokens of an uninterrupted run, for dense attention, the window and
// InfiniGen (its partial key cache rebuilt), greedy and sampled; worker A's late appends are
// refused (its id no longer exists); and when the rows are gone, B replays instead (exact only
// for dense attention: the reason to attach). The same takeover serves a conversation's next
// turn (EngineRequest::session_id), whose idle KV gives way to running sequences; and a copy of
// it starts the other samples of one prompt (EngineRequest::prefill_from, KvCache::Fork).
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/selection_config.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/faulty_kv_client.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::RandomTokens;

struct Outcome {
  std::vector<int32_t> tokens;
  EngineEvent last;
  uint64_t home = 0;
};

class Attach : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    l_ = testing::LoadModel(testing::FixturePath("hf/llama31_gqa"));
    ASSERT_NE(l_.model, nullptr);
    KvStoreConfig sc;
    sc.capacity_bytes = 64 << 20;
    sc.shared_memory = false;
    auto store = KvStore::Create(sc);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
    auto tokens = RandomTokens(96, l_.model->config().vocab_size, 5);
    PrepareOptions po;
    po.ratio = 0.5f;
    po.chunk_tokens = 40;
    auto s = PrepareInfinigen(*l_.model, *l_.ckpt, tokens, po);
    ASSERT_TRUE(s.ok()) << s.status();
    sidecar_ = std::move(*s);
    ASSERT_TRUE(AttachSidecar(*l_.model, *l_.ckpt, sidecar_).ok());
  }
  // A worker's client and cache over the shared store (its own owner and id range).
  struct Worker {
    std::unique_ptr<KvStoreClient> client;
    std::unique_ptr<StoreKvCache> cache;
  };
  Worker MakeWorker(const std::string& owner, uint64_t id_base) {
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = store_.get();
    cc.owner = owner;
    auto client = MakeKvStoreClient(cc);
    EXPECT_TRUE(client.ok()) << client.status();
    StoreKvCacheOptions options;
    options.id_base = id_base;
    options.owner = owner;
    Worker w;
    w.client = std::move(*client);
    w.cache = std::make_unique<StoreKvCache>(*l_.backend, l_.model->kv_shape(), *w.client, options);
    return w;
  }
  std::unique_ptr<KvSelectionPolicy> Policy() {
    if (GetParam() == "full") return nullptr;
    SelectionConfig config;
    config.policy = ParsePolicyKind(GetParam()).value();
    config.dense_layers = 1;  // the fixture has 2 layers: layer 1 selects
    config.budget_fraction = 0.3;
    config.recent_tokens = GetParam() == "window" ? 8 : 0;
    auto p = MakeSelectionPolicy(config, l_.model->config(), &sidecar_);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  GenerateOptions Options(bool sampled) {
    GenerateOptions o;
    o.max_new_tokens = 24;
    o.ignore_eos = true;
    o.sampling.temperature = sampled ? 0.8f : 0.0f;
    o.sampling.seed = 7;
    return o;
  }
  // One request through `engine`, to its end.
  static Outcome RunOn(BatchEngine& engine, EngineRequest r) {
    Outcome run;
    absl::Notification done;
    auto id = engine.Submit(std::move(r), [&](const EngineEvent& e) {
      if (e.token >= 0) run.tokens.push_back(e.token);
      if (e.home != 0) run.home = e.home;
      if (e.done) {
        run.last = e;
        done.Notify();
      }
    });
    EXPECT_TRUE(id.ok()) << id.status();
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
    return run;
  }
  // One request through an engine of its own over `cache`.
  Outcome Complete(StoreKvCache& cache, EngineRequest r) {
    BatchEngine engine(*l_.model, cache, EngineConfig{});
    return RunOn(engine, std::move(r));
  }

  testing::LoadedModel l_;
  std::unique_ptr<KvStore> store_;
  InfinigenSidecar sidecar_;
};

TEST_P(Attach, AStreamContinuesFromAnotherWorkersKvWithItsTokens) {
  for (bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "sampled" : "greedy");
    const auto prompt = RandomTokens(40, l_.model->config().vocab_size, 21);
    // The uninterrupted run, on a worker of its own.
    Worker base = MakeWorker("worker-base", 1 << 20);
    EngineRequest whole_request;
    whole_request.prompt = prompt;
    whole_request.options = Options(sampled);
    whole_request.policy = Policy();
    const Outcome whole = Complete(*base.cache, std::move(whole_request));
    ASSERT_TRUE(whole.last.status.ok()) << whole.last.status;
    ASSERT_EQ(whole.tokens.size(), 24u);

    // Worker A: the prompt and the first `sent` tokens, the last of which it never computed,
    // as its engine leaves them (decode steps through the same policy); then it dies.
    constexpr size_t kSent = 9;
    Worker a = MakeWorker("worker-a", 2 << 20);
    {
      auto policy = Policy();
      ASSERT_TRUE(a.cache->Open(1, 128).ok());
      if (policy) policy->Open(1, 128);
      DecodeStep step(*l_.model, *a.cache);
      std::vector<float> logits(l_.model->config().vocab_size);
      ForwardChunk chunk{1, 0, prompt, false, policy.get()};
      ASSERT_TRUE(step.Forward({&chunk, 1}, logits).ok());
      for (size_t i = 0; i + 1 < kSent; ++i) {
        ForwardChunk c{
            1, static_cast<int64_t>(prompt.size() + i), {&whole.tokens[i], 1}, false, policy.get()};
        ASSERT_TRUE(step.Forward({&c, 1}, logits).ok());
      }
    }
    const uint64_t home = a.cache->Home(1);
    ASSERT_NE(home, 0u);

    // Worker B continues from A's rows.
    Worker b = MakeWorker("worker-b", 3 << 20);
    EngineRequest rest;
    rest.prompt = prompt;
    rest.resume_tokens.assign(whole.tokens.begin(), whole.tokens.begin() + kSent);
    rest.attach_home = home;
    rest.options = Options(sampled);
    rest.policy = Policy();
    const Outcome resumed = Complete(*b.cache, std::move(rest));
    ASSERT_TRUE(resumed.last.status.ok()) << resumed.last.status;
    EXPECT_EQ(resumed.tokens,
              std::vector<int32_t>(whole.tokens.begin() + kSent, whole.tokens.end()));
    EXPECT_TRUE(resumed.last.usage.attached);
    EXPECT_EQ(resumed.last.usage.cached_tokens, static_cast<int64_t>(prompt.size() + kSent - 1));
    EXPECT_NE(resumed.home, home) << "B reports its own id for the next takeover";

    // A wakes up: its appends and its close find nothing (B's rows were never touched).
    std::vector<uint8_t> row(l_.model->kv_shape().BytesPerToken() / l_.model->config().num_layers /
                             2);
    a.client->AppendAsync(home, 0, static_cast<int64_t>(prompt.size() + kSent - 1), 1, row, row);
    EXPECT_EQ(a.client->Flush(absl::InfiniteFuture()).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(a.client->Close(home).code(), absl::StatusCode::kNotFound);
  }
}

TEST_P(Attach, RowsThatAreGoneAreReplayed) {
  const auto prompt = RandomTokens(30, l_.model->config().vocab_size, 22);
  Worker base = MakeWorker("worker-base", 1 << 20);
  EngineRequest whole_request;
  whole_request.prompt = prompt;
  whole_request.options = Options(false);
  whole_request.policy = Policy();
  const Outcome whole = Complete(*base.cache, std::move(whole_request));
  ASSERT_TRUE(whole.last.status.ok()) << whole.last.status;
  Worker b = MakeWorker("worker-b", 3 << 20);
  EngineRequest rest;
  rest.prompt = prompt;
  rest.resume_tokens.assign(whole.tokens.begin(), whole.tokens.begin() + 5);
  rest.attach_home = 12345;  // the store has no such sequence (its worker's lease lapsed)
  rest.options = Options(false);
  rest.policy = Policy();
  const Outcome replayed = Complete(*b.cache, std::move(rest));
  ASSERT_TRUE(replayed.last.status.ok()) << replayed.last.status;
  // A replay prefills the resumed tokens, which the first run decoded: with dense attention
  // that is the same computation (batch-invariant kernels); a policy that attended to fewer
  // rows while decoding them gives other K/V here, so only the length is the same.
  if (GetParam() == "full") {
    EXPECT_EQ(replayed.tokens, std::vector<int32_t>(whole.tokens.begin() + 5, whole.tokens.end()));
  }
  EXPECT_EQ(replayed.tokens.size(), whole.tokens.size() - 5);
  EXPECT_FALSE(replayed.last.usage.attached);
  EXPECT_EQ(replayed.last.usage.cached_tokens, 0);
}

// The stored KV exists but the store does not answer the takeover (UNAVAILABLE): the call fails
// UNAVAILABLE for the router to try the resume again, instead of recomputing the stream; the
// next try, with the store back, takes the rows over.
TEST_P(Attach, ATakeoverTheStoreCannotAnswerNowFailsForTheRouterToRetry) {
  const auto prompt = RandomTokens(30, l_.model->config().vocab_size, 23);
  Worker a = MakeWorker("worker-a", 2 << 20);
  EngineRequest first;
  first.prompt = prompt;
  first.options = Options(false);
  first.options.max_new_tokens = 6;
  first.policy = Policy();
  first.session_id = "kept";  // its KV stays in the store when it ends
  BatchEngine engine_a(*l_.model, *a.cache, EngineConfig{});
  const Outcome kept = RunOn(engine_a, std::move(first));
  ASSERT_TRUE(kept.last.status.ok()) << kept.last.status;
  ASSERT_NE(kept.home, 0u);

  Worker b = MakeWorker("worker-b", 3 << 20);
  testing::FaultyKvClient faulty(*b.client);
  faulty.Fail(testing::FaultyKvClient::Op::kAttach, kept.home,
              absl::UnavailableError("the store is not reachable"));
  StoreKvCacheOptions options;
  options.id_base = 3 << 20;
  options.owner = "worker-b";
  StoreKvCache cache(*l_.backend, l_.model->kv_shape(), faulty, options);
  BatchEngine engine_b(*l_.model, cache, EngineConfig{});
  auto resume = [&] {
    EngineRequest r;
    r.prompt = prompt;
    r.resume_tokens = kept.tokens;
    r.attach_home = kept.home;
    r.options = Options(false);
    r.options.max_new_tokens = 10;
    r.policy = Policy();
    return r;
  };
  const Outcome refused = RunOn(engine_b, resume());
  EXPECT_EQ(refused.last.status.code(), absl::StatusCode::kUnavailable) << refused.last.status;
  EXPECT_NE(refused.last.status.message().find("retry the resume"), std::string::npos)
      << refused.last.status;
  EXPECT_TRUE(refused.tokens.empty());
  faulty.Heal();
  const Outcome resumed = RunOn(engine_b, resume());
  ASSERT_TRUE(resumed.last.status.ok()) << resumed.last.status;
  EXPECT_TRUE(resumed.last.usage.attached);
  EXPECT_EQ(resumed.tokens.size(), 4u);  // 10 in all, 6 of them resumed
}

// A conversation: the second request of a session, whose prompt is the first's prompt and
// answer plus a new turn, takes the session's stored KV over and prefills only the new tokens;
// with dense attention its tokens are those of a cold run of the same prompt (a sparse policy
// decoded the first answer over fewer rows than a cold prefill of it attends to).
TEST_P(Attach, AConversationsNextTurnPrefillsOnlyItsNewTokens) {
  Worker w = MakeWorker("worker-s", 4 << 20);
  BatchEngine engine(*l_.model, *w.cache, EngineConfig{});
  auto run = [&](std::vector<int32_t> prompt, const std::string& session) {
    EngineRequest r;
    r.prompt = std::move(prompt);
    r.session_id = session;
    r.options = Options(false);
    r.policy = Policy();
    return RunOn(engine, std::move(r));
  };
  const auto first_prompt = RandomTokens(40, l_.model->config().vocab_size, 31);
  const Outcome first = run(first_prompt, "conversation-1");
  ASSERT_TRUE(first.last.status.ok()) << first.last.status;
  EXPECT_EQ(first.last.usage.cached_tokens, 0);
  std::vector<int32_t> second_prompt = first_prompt;
  second_prompt.insert(second_prompt.end(), first.tokens.begin(), first.tokens.end());
  const auto turn = RandomTokens(12, l_.model->config().vocab_size, 32);
  second_prompt.insert(second_prompt.end(), turn.begin(), turn.end());
  const Outcome second = run(second_prompt, "conversation-1");
  ASSERT_TRUE(second.last.status.ok()) << second.last.status;
  // Stored: the first prompt and answer but its last token (never computed there).
  EXPECT_EQ(second.last.usage.cached_tokens,
            static_cast<int64_t>(first_prompt.size() + first.tokens.size() - 1));
  EXPECT_FALSE(second.last.usage.attached) << "not a failover";
  // Another session, or a prompt that shares nothing, computes everything.
  const Outcome other = run(second_prompt, "conversation-2");
  EXPECT_EQ(other.last.usage.cached_tokens, 0);
  if (GetParam() == "full") {
    EXPECT_EQ(second.tokens, other.tokens) << "a reused conversation equals a cold run";
  }
  const Outcome diverged =
      run(RandomTokens(30, l_.model->config().vocab_size, 33), "conversation-1");
  EXPECT_EQ(diverged.last.usage.cached_tokens, 0);
}

// Idle conversations hold store memory only while nothing running needs it: a store with room
// for about one long sequence keeps a session, then a new request that needs the room closes
// it (never a running sequence); and sessions past their TTL are closed.
TEST_P(Attach, IdleSessionsMakeRoomAndExpire) {
  KvStoreConfig sc;
  sc.block_tokens = 16;
  sc.shared_memory = false;
  const KvCacheShape& shape = l_.model->kv_shape();
  // Room for one sequence of 108 tokens and a half: blocks per (layer, KV head, K or V).
  const size_t block_bytes = KvStore::Create(sc).value()->arena().block_bytes();
  const size_t rows_per_block = block_bytes / (shape.head_dim * DTypeSize(shape.dtype));
  const size_t blocks =
      2 * shape.num_layers * shape.num_kv_heads * ((108 + rows_per_block - 1) / rows_per_block);
  sc.capacity_bytes = block_bytes * (blocks + blocks / 2);
  auto small = KvStore::Create(sc);
  ASSERT_TRUE(small.ok()) << small.status();
  KvClientConfig cc;
  cc.transport = KvClientConfig::Transport::kInProcess;
  cc.store = small->get();
  auto client = MakeKvStoreClient(cc);
  ASSERT_TRUE(client.ok());
  StoreKvCacheOptions options;
  options.id_base = 100;
  StoreKvCache cache(*l_.backend, l_.model->kv_shape(), **client, options);
  EngineConfig config;
  config.max_running = 1;
  auto engine = std::make_unique<BatchEngine>(*l_.model, cache, config);
  auto run = [&](int prompt_tokens, const std::string& session, unsigned seed) {
    EngineRequest r;
    r.prompt = RandomTokens(prompt_tokens, l_.model->config().vocab_size, seed);
    r.session_id = session;
    r.options = Options(false);
    r.options.max_new_tokens = 8;
    r.policy = Policy();
    return RunOn(*engine, std::move(r)).last;
  };
  EngineEvent e = run(100, "a", 41);
  ASSERT_TRUE(e.status.ok()) << e.status.ToString();
  EXPECT_EQ((*small)->Stats().sequences, 1) << "session a is kept";
  e = run(100, "b", 42);  // needs the room session a holds
  ASSERT_TRUE(e.status.ok()) << e.status;
  EXPECT_EQ((*small)->Stats().sequences, 1) << "a was closed for b, b is kept";
  engine.reset();
  EXPECT_EQ((*small)->Stats().sequences, 0) << "a stopping engine closes its sessions";
  config.session_ttl = absl::ZeroDuration();  // every session past its TTL at once
  engine = std::make_unique<BatchEngine>(*l_.model, cache, config);
  e = run(20, "c", 43);
  ASSERT_TRUE(e.status.ok()) << e.status;
  EXPECT_EQ((*small)->Stats().sequences, 0) << "an expired session is closed";
}

// The samples of one prompt (EngineRequest::prefill_from, a request with n > 1): the first
// prefills, the others wait for it and start from a copy of its KV (KvCache::Fork) and draw
// their first token from its last prompt logits (their usage: the whole prompt cached; the
// engine computed the prompt once), each sampling exactly the tokens it samples alone with its
// seed (the policy's state rebuilt from the copy); a first sample that ends at its first token
// still leaves its KV and logits; on a cache that cannot copy they prefill alone, with the same
// tokens.
TEST_P(Attach, SamplesOfOnePromptShareItsPrefill) {
  const auto prompt = RandomTokens(40, l_.model->config().vocab_size, 31);
  auto options = [&](int i, int64_t first_tokens) {
    GenerateOptions o = Options(/*sampled=*/true);
    o.sampling.seed = 70 + i;
    if (i == 0) o.max_new_tokens = first_tokens;
    return o;
  };
  for (int64_t first_tokens : {int64_t{24}, int64_t{1}}) {
    SCOPED_TRACE(absl::StrCat("the first sample generates ", first_tokens));
    std::vector<std::vector<int32_t>> alone;
    for (int i = 0; i < 3; ++i) {
      Worker w = MakeWorker(absl::StrCat("worker-alone-", i), static_cast<uint64_t>(6 + i) << 20);
      EngineRequest r;
      r.prompt = prompt;
      r.options = options(i, first_tokens);
      r.policy = Policy();
      alone.push_back(Complete(*w.cache, std::move(r)).tokens);
    }
    Worker w = MakeWorker("worker-n", 9 << 20);
    BackendKvCache local(*l_.backend, l_.model->kv_shape());
    for (KvCache* cache : {static_cast<KvCache*>(w.cache.get()), static_cast<KvCache*>(&local)}) {
      const bool copies = cache == w.cache.get();
      SCOPED_TRACE(copies ? "over the store" : "a cache that cannot copy");
      EngineConfig config;
      config.prefill_budget_tokens = 16;  // the prompt takes three steps; the copies wait
      BatchEngine engine(*l_.model, *cache, config);
      std::vector<Outcome> got(3);
      std::vector<absl::Notification> done(3);
      uint64_t first = 0;
      for (int i = 0; i < 3; ++i) {
        EngineRequest r;
        r.prompt = prompt;
        r.options = options(i, first_tokens);
        r.policy = Policy();
        r.prefill_from = first;
        auto id = engine.Submit(std::move(r), [&got, &done, i](const EngineEvent& e) {
          if (e.token >= 0) got[i].tokens.push_back(e.token);
          if (e.done) {
            got[i].last = e;
            done[i].Notify();
          }
        });
        ASSERT_TRUE(id.ok()) << id.status();
        if (i == 0) first = *id;
      }
      for (int i = 0; i < 3; ++i) {
        ASSERT_TRUE(done[i].WaitForNotificationWithTimeout(absl::Seconds(60)));
        EXPECT_TRUE(got[i].last.status.ok()) << got[i].last.status;
        EXPECT_EQ(got[i].tokens, alone[i]) << "sample " << i;
        EXPECT_EQ(got[i].last.usage.cached_tokens, i > 0 && copies ? 40 : 0) << "sample " << i;
      }
      EXPECT_EQ(engine.Stats().prompt_tokens, copies ? 40 : 3 * 40);
    }
    EXPECT_EQ(store_->Stats().sequences, 0) << "every copy and the first sample were closed";
  }
  // Only an earlier request's prefill can be shared.
  Worker w = MakeWorker("worker-bad", 10 << 20);
  BatchEngine engine(*l_.model, *w.cache, EngineConfig{});
  EngineRequest r;
  r.prompt = prompt;
  r.options = Options(false);
  r.prefill_from = 99;
  EXPECT_EQ(engine.Submit(std::move(r), [](const EngineEvent&) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Policies, Attach, ::testing::Values("full", "window", "infinigen"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace infinigen
