// The continuous-batching engine on a tiny fixture model: each request of a concurrent mix
// (different prompts, lengths and sampling) produces exactly the tokens it produces alone with
// the one-sequence Generate(); cancellation and deadlines end a request and free its cache
// sequence; a full queue and bad requests are refused with the right codes; a resumed request
// continues as the original would have; over the KV store, a sequence the store loses mid-stream,
// or whose gathers or appends fail (FaultyKvClient), fails alone while the rest of its batch goes
// on unchanged.
#include "gpu_worker/engine/batch_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/store_kv_cache.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/faulty_kv_client.h"
#include "tests/support/fixture_model.h"
#include "tests/support/test_paths.h"

namespace infinigen {
namespace {

using testing::RandomTokens;

// Collects one request's events.
struct Collector {
  absl::Mutex mu;
  std::vector<int32_t> tokens;
  EngineEvent last;
  absl::Notification done;
  EventSink Sink() {
    return [this](const EngineEvent& e) {
      {
        absl::MutexLock l(&mu);
        if (e.token >= 0) tokens.push_back(e.token);
        if (e.done) last = e;
      }
      // Outside the lock: the waiter may destroy this Collector (and mu) once notified.
      if (e.done) done.Notify();
    };
  }
};

// Submits `r` and waits for its end (failing the test after 30 s): its token events.
std::vector<EngineEvent> TokenEvents(BatchEngine& engine, EngineRequest r) {
  std::vector<EngineEvent> events;
  absl::Notification done;
  const absl::StatusOr<uint64_t> id = engine.Submit(std::move(r), [&](const EngineEvent& e) {
    if (e.token >= 0) events.push_back(e);
    if (e.done) done.Notify();
  });
  EXPECT_TRUE(id.ok()) << id.status();
  if (id.ok()) {
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
  return events;
}

// A double-precision log-softmax of one row of logits (the reference for logprobs).
std::vector<double> LogSoftmax(const float* row, int64_t vocab) {
  double mx = -1e300, sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) mx = std::max(mx, static_cast<double>(row[v]));
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - mx);
  std::vector<double> out(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) out[v] = row[v] - mx - std::log(sum);
  return out;
}

class Engine : public ::testing::Test {
 public:
  void SetUp() override {
    l_ = testing::LoadModel(testing::FixturePath("hf/llama31_gqa"));
    ASSERT_NE(l_.model, nullptr);
    vocab_ = l_.model->config().vocab_size;
  }
  GenerateOptions Options(int i) {
    GenerateOptions o;
    o.max_new_tokens = 12 + 3 * (i % 4);
    o.ignore_eos = true;
    o.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    o.sampling.top_k = i % 3 == 0 ? 0 : 20;
    o.sampling.seed = 100 + i;
    return o;
  }
  std::vector<int32_t> Alone(const std::vector<int32_t>& prompt, const GenerateOptions& o) {
    BackendKvCache cache(*l_.backend, l_.model->kv_shape());
    auto r = Generate(*l_.model, cache, 1, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->tokens : std::vector<int32_t>{};
  }

  testing::LoadedModel l_;
  int64_t vocab_ = 0;
};

TEST_F(Engine, ConcurrentRequestsEachProduceWhatTheyProduceAlone) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.max_running = 4;             // fewer slots than requests: some wait, then join mid-flight
  config.prefill_budget_tokens = 16;  // long prompts take several steps beside the decodes
  BatchEngine engine(*l_.model, cache, config);
  constexpr int kRequests = 10;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Collector> got(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(RandomTokens(5 + 9 * i, vocab_, 30 + i));
    EngineRequest r;
    r.prompt = prompts[i];
    r.options = Options(i);
    ASSERT_TRUE(engine.Submit(std::move(r), got[i].Sink()).ok());
  }
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(got[i].done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  }
  // The engine is idle now (the model is not thread-safe): run each request alone.
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_TRUE(got[i].last.status.ok()) << got[i].last.status;
    EXPECT_EQ(got[i].last.finish_reason, FinishReason::kLength);
    EXPECT_EQ(got[i].tokens, Alone(prompts[i], Options(i))) << "request " << i;
    EXPECT_EQ(got[i].last.usage.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    EXPECT_EQ(got[i].last.usage.generated_tokens, Options(i).max_new_tokens);
  }
  const EngineStats stats = engine.Stats();
  EXPECT_EQ(stats.finished, kRequests);
  EXPECT_GT(stats.steps, 0);
  EXPECT_EQ(cache.bytes_reserved(), 0u) << "every sequence was closed";
}

TEST_F(Engine, CancelAndDeadlineFreeTheSequence) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  BatchEngine engine(*l_.model, cache, EngineConfig{});
  Collector cancelled, timed_out, late;
  EngineRequest a;
  a.prompt = RandomTokens(8, vocab_, 1);
  a.options.max_new_tokens = 200;
  a.options.ignore_eos = true;
  absl::Notification some;
  Collector* c = &cancelled;
  auto id = engine.Submit(std::move(a), [c, &some](const EngineEvent& e) {
    c->Sink()(e);
    if (e.token >= 0 && !some.HasBeenNotified()) some.Notify();
    absl::SleepFor(absl::Milliseconds(2));  // a slow client: 200 tokens take 0.4 s
  });
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(some.WaitForNotificationWithTimeout(absl::Seconds(30)));
  engine.Cancel(*id);
  ASSERT_TRUE(cancelled.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(cancelled.last.status.ok());
  EXPECT_EQ(cancelled.last.finish_reason, FinishReason::kCancelled);
  EXPECT_LT(cancelled.tokens.size(), 200u);

  EngineRequest b;
  b.prompt = RandomTokens(8, vocab_, 2);
  b.options.max_new_tokens = 200;
  b.options.ignore_eos = true;
  b.deadline = absl::Now() + absl::Milliseconds(30);
  Collector* t = &timed_out;
  ASSERT_TRUE(engine
                  .Submit(std::move(b),
                          [t](const EngineEvent& e) {
                            t->Sink()(e);
                            absl::SleepFor(absl::Milliseconds(2));
                          })
                  .ok());
  ASSERT_TRUE(timed_out.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(timed_out.last.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GT(timed_out.tokens.size(), 0u);
  EXPECT_LT(timed_out.tokens.size(), 200u);
  // A deadline already gone: it never runs.
  EngineRequest d;
  d.prompt = RandomTokens(8, vocab_, 3);
  d.deadline = absl::Now() - absl::Milliseconds(1);
  ASSERT_TRUE(engine.Submit(std::move(d), late.Sink()).ok());
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(late.last.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(late.tokens.empty());
  // Both sequences are gone from the cache.
  for (int i = 0; i < 100 && cache.bytes_reserved() != 0; ++i)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(cache.bytes_reserved(), 0u);
}

// The queue's prompt tokens are capped (what waiting prefills will cost, not only how many
// wait): with one request running, requests queue while their prompts fit
// max_queued_prompt_tokens, the next is refused naming the limit, and one that fits still
// queues; all admitted ones finish.
TEST_F(Engine, QueuedPromptTokensAreCapped) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.max_running = 1;
  config.max_queued = 10;
  config.max_queued_prompt_tokens = 20;
  BatchEngine engine(*l_.model, cache, config);
  std::vector<Collector> c(4);
  auto submit = [&](int i, int prompt, int new_tokens) {
    EngineRequest r;
    r.prompt = RandomTokens(prompt, vocab_, 40 + i);
    r.options.max_new_tokens = new_tokens;
    r.options.ignore_eos = true;
    Collector* ci = &c[i];
    return engine.Submit(std::move(r), [ci](const EngineEvent& e) {
      ci->Sink()(e);
      absl::SleepFor(absl::Milliseconds(2));
    });
  };
  ASSERT_TRUE(submit(0, 4, 120).ok());  // runs, and keeps the one slot for a while
  for (int i = 0; i < 500; ++i) {
    const EngineStats s = engine.Stats();
    if (s.running == 1 && s.queued == 0) break;
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_TRUE(submit(1, 12, 2).ok());                      // 12 waiting
  const absl::Status refused = submit(2, 12, 2).status();  // 24 > 20
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("max_queued_prompt_tokens"), std::string::npos) << refused;
  ASSERT_TRUE(submit(3, 8, 2).ok());  // 20: fits
  for (int i : {0, 1, 3}) {
    ASSERT_TRUE(c[i].done.WaitForNotificationWithTimeout(absl::Seconds(60))) << i;
    EXPECT_TRUE(c[i].last.status.ok()) << i << ": " << c[i].last.status;
  }
  EngineConfig bad;
  bad.max_queued_prompt_tokens = -1;
  EXPECT_EQ(bad.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(Engine, BadRequestsAndAFullQueueAreRefused) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.max_running = 1;
  config.max_queued = 1;
  BatchEngine engine(*l_.model, cache, config);
  EngineRequest empty;
  EXPECT_EQ(engine.Submit(std::move(empty), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EngineRequest bad_id;
  bad_id.prompt = {1, static_cast<int32_t>(vocab_)};
  auto st = engine.Submit(std::move(bad_id), {}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("vocabulary"), std::string::npos) << st;
  EngineRequest too_long;
  too_long.prompt = {1, 2};
  too_long.options.max_new_tokens = l_.model->config().max_position_embeddings;
  EXPECT_EQ(engine.Submit(std::move(too_long), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EngineRequest bad_sampling;
  bad_sampling.prompt = {1, 2};
  bad_sampling.options.sampling.top_p = 2.0f;
  EXPECT_EQ(engine.Submit(std::move(bad_sampling), {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Fill the one slot and the one queue place (long requests), then one more is refused.
  std::vector<Collector> c(8);
  std::vector<uint64_t> ids;
  bool refused = false;
  for (int i = 0; i < 8 && !refused; ++i) {
    EngineRequest r;
    r.prompt = RandomTokens(4, vocab_, i);
    r.options.max_new_tokens = 100;
    r.options.ignore_eos = true;
    Collector* ci = &c[i];
    auto id = engine.Submit(std::move(r), [ci](const EngineEvent& e) {
      ci->Sink()(e);
      absl::SleepFor(absl::Milliseconds(5));
    });
    if (!id.ok()) {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted) << id.status();
      refused = true;
    } else {
      ids.push_back(*id);
    }
  }
  EXPECT_TRUE(refused);
  EXPECT_EQ(ids.size(), 2u) << "one running and one queued";
  for (uint64_t id : ids) engine.Cancel(id);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_TRUE(c[i].done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_EQ(c[i].last.finish_reason, FinishReason::kCancelled);
  }
}

TEST_F(Engine, AdmissionByDeviceMemory) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.device_bytes_per_token = 1000;
  config.device_memory_bytes = 1000 * 60;  // one 10 + 40 token request fits, two do not
  BatchEngine engine(*l_.model, cache, config);
  EngineRequest huge;
  huge.prompt = RandomTokens(30, vocab_, 1);
  huge.options.max_new_tokens = 40;
  auto st = engine.Submit(std::move(huge), {}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("device memory"), std::string::npos) << st;
  absl::Mutex mu;
  std::vector<std::pair<int, bool>> order;  // (request, done) in event order
  std::vector<Collector> c(2);
  for (int i = 0; i < 2; ++i) {
    EngineRequest r;
    r.prompt = RandomTokens(10, vocab_, 2 + i);
    r.options.max_new_tokens = 40;
    r.options.ignore_eos = true;
    Collector* ci = &c[i];
    ASSERT_TRUE(engine
                    .Submit(std::move(r),
                            [&, i, ci](const EngineEvent& e) {
                              {
                                absl::MutexLock l(&mu);
                                order.push_back({i, e.done});
                              }
                              ci->Sink()(e);
                            })
                    .ok());
  }
  for (auto& ci : c) ASSERT_TRUE(ci.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The second request ran only after the first had finished and given its memory back.
  absl::MutexLock l(&mu);
  size_t first_done = 0, second_first = order.size();
  for (size_t k = 0; k < order.size(); ++k) {
    if (order[k].first == 0 && order[k].second) first_done = k;
    if (order[k].first == 1 && second_first == order.size()) second_first = k;
  }
  EXPECT_LT(first_done, second_first);
  EXPECT_EQ(c[1].tokens.size(), 40u);
}

TEST_F(Engine, AResumedRequestContinuesAsTheOriginal) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  BatchEngine engine(*l_.model, cache, EngineConfig{});
  GenerateOptions o = Options(1);  // sampled, not greedy
  const auto prompt = RandomTokens(11, vocab_, 77);
  const std::vector<int32_t> whole = Alone(prompt, o);  // while the engine is idle
  const size_t sent = 5;
  EngineRequest r;
  r.prompt = prompt;
  r.resume_tokens.assign(whole.begin(), whole.begin() + sent);
  r.options = o;
  Collector rest;
  ASSERT_TRUE(engine.Submit(std::move(r), rest.Sink()).ok());
  ASSERT_TRUE(rest.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(rest.tokens, std::vector<int32_t>(whole.begin() + sent, whole.end()));
}

// Logprobs: with each generated token, its log-probability and the top alternatives under the
// model's logits (before sampling changes them), against a double log-softmax of the logits a
// plain forward pass over the same tokens gives; greedy picks the most likely one.
TEST_F(Engine, LogprobsAreThoseOfTheModelsLogits) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  BatchEngine engine(*l_.model, cache, EngineConfig{});
  for (float temperature : {0.0f, 0.9f}) {
    const auto prompt = RandomTokens(13, vocab_, 51);
    EngineRequest r;
    r.prompt = prompt;
    r.options.max_new_tokens = 6;
    r.options.ignore_eos = true;
    r.options.sampling.temperature = temperature;
    r.options.sampling.seed = 5;
    r.options.logprobs = 3;
    const std::vector<EngineEvent> events = TokenEvents(engine, std::move(r));
    ASSERT_EQ(events.size(), 6u);
    std::vector<int32_t> all = prompt;
    for (const EngineEvent& e : events) all.push_back(e.token);
    const std::vector<float> logits = testing::ChunkedLogits(*l_.model, all, 64);
    for (size_t j = 0; j < events.size(); ++j) {
      const EngineEvent& e = events[j];
      ASSERT_TRUE(e.has_logprobs);
      const std::vector<double> lp =
          LogSoftmax(logits.data() + (prompt.size() - 1 + j) * vocab_, vocab_);
      EXPECT_NEAR(e.logprobs.logprob, lp[e.token], 1e-4) << "token " << j;
      ASSERT_EQ(e.logprobs.top.size(), 3u);
      for (int t = 0; t < 3; ++t) {
        EXPECT_NEAR(e.logprobs.top[t].second, lp[e.logprobs.top[t].first], 1e-4);
        if (t > 0) EXPECT_GE(e.logprobs.top[t - 1].second, e.logprobs.top[t].second);
      }
      if (temperature == 0.0f) EXPECT_EQ(e.logprobs.top[0].first, e.token);
    }
  }
  EngineRequest bad;
  bad.prompt = {1, 2, 3};
  bad.options.logprobs = 21;
  auto refused = engine.Submit(std::move(bad), [](const EngineEvent&) {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("sampling.logprobs"), std::string::npos);
}

// Prompt logprobs: with the first token, each prompt token's log-probability given the tokens
// before it and the top alternatives, against a double log-softmax of a plain forward pass's
// logits; the prompt prefilled in chunks across steps beside another request's decode, whose
// tokens, like this request's own, are what they are without prompt logprobs.
TEST_F(Engine, PromptLogprobsAreThoseOfTheModelsLogits) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.prefill_budget_tokens = 8;  // 29 prompt tokens: four chunks, over several steps
  BatchEngine engine(*l_.model, cache, config);
  const auto prompt = RandomTokens(29, vocab_, 77);
  const auto other_prompt = RandomTokens(5, vocab_, 78);
  EngineRequest r, other;
  r.prompt = prompt;
  r.options = Options(1);
  r.options.prompt_logprobs = 4;
  other.prompt = other_prompt;
  other.options = Options(2);
  const std::vector<int32_t> want = Alone(prompt, Options(1));
  const std::vector<int32_t> other_want = Alone(other_prompt, Options(2));
  Collector other_got;
  ASSERT_TRUE(engine.Submit(std::move(other), other_got.Sink()).ok());
  const std::vector<EngineEvent> events = TokenEvents(engine, std::move(r));
  ASSERT_TRUE(other_got.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(other_got.tokens, other_want);
  ASSERT_FALSE(events.empty());
  std::vector<int32_t> tokens;
  for (const EngineEvent& e : events) tokens.push_back(e.token);
  EXPECT_EQ(tokens, want);
  ASSERT_TRUE(events[0].has_prompt_logprobs);
  for (size_t j = 1; j < events.size(); ++j) EXPECT_FALSE(events[j].has_prompt_logprobs);
  const std::vector<TokenLogprobs>& got = events[0].prompt_logprobs;
  ASSERT_EQ(got.size(), prompt.size() - 1);
  const std::vector<float> logits = testing::ChunkedLogits(*l_.model, prompt, 64);
  for (size_t p = 0; p + 1 < prompt.size(); ++p) {
    SCOPED_TRACE(absl::StrCat("prompt token ", p + 1));
    const std::vector<double> lp = LogSoftmax(logits.data() + p * vocab_, vocab_);
    EXPECT_NEAR(got[p].logprob, lp[prompt[p + 1]], 1e-4);
    ASSERT_EQ(got[p].top.size(), 4u);
    for (int t = 0; t < 4; ++t) {
      EXPECT_NEAR(got[p].top[t].second, lp[got[p].top[t].first], 1e-4);
      if (t > 0) {
        EXPECT_GE(got[p].top[t - 1].second, got[p].top[t].second);
      }
    }
  }
  EngineRequest bad;
  bad.prompt = {1, 2, 3};
  bad.options.prompt_logprobs = 21;
  auto refused = engine.Submit(std::move(bad), [](const EngineEvent&) {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("sampling.prompt_logprobs"), std::string::npos);
}

// max_new_tokens 0: the prompt computed (a whole context of it), one event without a token with
// its prompt logprobs (those of a request for one token), then the end: finish length, nothing
// generated. One token more than the context is refused.
TEST_F(Engine, APromptOnlyRequestComputesItsPromptAndEndsWithoutAToken) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  EngineConfig config;
  config.prefill_budget_tokens = 64;
  BatchEngine engine(*l_.model, cache, config);
  const int64_t context = l_.model->config().max_position_embeddings;
  const auto prompt = RandomTokens(static_cast<int>(context), vocab_, 79);
  GenerateOptions options = Options(0);
  options.prompt_logprobs = 2;
  EngineRequest one;
  one.prompt = std::vector<int32_t>(prompt.begin(), prompt.end() - 1);  // room for one token
  one.options = options;
  one.options.max_new_tokens = 1;
  const std::vector<EngineEvent> with_token = TokenEvents(engine, std::move(one));
  ASSERT_EQ(with_token.size(), 1u);

  std::vector<EngineEvent> events;
  absl::Notification done;
  EngineRequest r;
  r.prompt = prompt;
  r.options = options;
  r.options.max_new_tokens = 0;
  ASSERT_TRUE(engine
                  .Submit(std::move(r),
                          [&](const EngineEvent& e) {
                            events.push_back(e);
                            if (e.done) done.Notify();
                          })
                  .ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].token, -1);
  EXPECT_FALSE(events[0].done);
  ASSERT_TRUE(events[0].has_prompt_logprobs);
  ASSERT_EQ(events[0].prompt_logprobs.size(), prompt.size() - 1);
  // The prompt shared with the one-token request: the same entries (its last chunk is one row
  // shorter; the CPU's kernels give each row the same bits whatever the rows beside it).
  const std::vector<TokenLogprobs>& shorter = with_token[0].prompt_logprobs;
  ASSERT_EQ(shorter.size(), prompt.size() - 2);
  for (size_t p = 0; p < shorter.size(); ++p) {
    EXPECT_NEAR(events[0].prompt_logprobs[p].logprob, shorter[p].logprob, 1e-5) << p;
  }
  EXPECT_TRUE(events[1].done);
  EXPECT_TRUE(events[1].status.ok()) << events[1].status;
  EXPECT_EQ(events[1].finish_reason, FinishReason::kLength);
  EXPECT_EQ(events[1].usage.generated_tokens, 0);
  EXPECT_EQ(events[1].usage.prompt_tokens, context);

  EngineRequest over;
  over.prompt = RandomTokens(static_cast<int>(context) + 1, vocab_, 80);
  over.options = options;
  over.options.max_new_tokens = 0;
  auto refused = engine.Submit(std::move(over), [](const EngineEvent&) {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
}

// min_tokens, logit_bias and the stop token: a stop token that greedy decoding would emit first
// ends the request at once and is reported; with min_tokens it cannot end it before then;
// a +100 bias forces a token, a -100 bias bans one.
TEST_F(Engine, MinTokensLogitBiasAndTheStopToken) {
  BackendKvCache cache(*l_.backend, l_.model->kv_shape());
  BatchEngine engine(*l_.model, cache, EngineConfig{});
  const auto prompt = RandomTokens(11, vocab_, 61);
  GenerateOptions greedy;
  greedy.max_new_tokens = 8;
  greedy.ignore_eos = true;
  greedy.sampling.temperature = 0.0f;
  const int32_t first = Alone(prompt, greedy).at(0);
  auto run = [&](const GenerateOptions& o) {
    EngineRequest r;
    r.prompt = prompt;
    r.options = o;
    // Shared with the sink: the engine thread still holds the collector's lock when it notifies.
    auto c = std::make_shared<Collector>();
    EXPECT_TRUE(
        engine.Submit(std::move(r), [c, sink = c->Sink()](const EngineEvent& e) { sink(e); }).ok());
    EXPECT_TRUE(c->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    absl::MutexLock l(&c->mu);
    return std::make_pair(c->tokens, c->last);
  };
  GenerateOptions o = greedy;
  o.stop_token_ids = {first};
  auto [stopped, end] = run(o);
  EXPECT_EQ(stopped, std::vector<int32_t>{first});
  EXPECT_EQ(end.finish_reason, FinishReason::kStop);
  EXPECT_EQ(end.stop_token, first);
  o.min_tokens = 4;
  auto [held, held_end] = run(o);
  ASSERT_GE(held.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(held[i], first) << "token " << i;
  if (held_end.finish_reason == FinishReason::kStop) EXPECT_EQ(held.back(), first);
  GenerateOptions biased = greedy;
  biased.logit_bias = {{7, 100.0f}};
  EXPECT_EQ(run(biased).first, std::vector<int32_t>(8, 7));
  biased.logit_bias = {{first, -100.0f}};
  EXPECT_NE(run(biased).first.at(0), first);
  biased.logit_bias = {{first, 101.0f}};
  EngineRequest bad;
  bad.prompt = prompt;
  bad.options = biased;
  EXPECT_EQ(engine.Submit(std::move(bad), [](const EngineEvent&) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  biased.logit_bias = {{static_cast<int32_t>(vocab_), 1.0f}};
  bad.prompt = prompt;
  bad.options = biased;
  EXPECT_EQ(engine.Submit(std::move(bad), [](const EngineEvent&) {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Isolation: a batch of 8 decodes over the KV store (in-process, rows read in place or copied,
// through FaultyKvClient); after the third token of request kLost, `inject` makes the store fail
// that request's sequence (by its store id). That request ends with the fault's code (`want`),
// naming the KV cache, after a prefix of the tokens it produces alone; the other seven produce
// exactly the tokens they produce alone, and every store sequence is closed at the end.
void ExpectAFaultFailsItsSequenceAlone(
    Engine& t, const testing::LoadedModel& l, int64_t vocab,
    const std::function<void(KvStore&, testing::FaultyKvClient&, StoreSequenceId)>& inject,
    absl::StatusCode want, bool through_faulty = true,
    absl::Duration fetch_timeout = absl::Seconds(5), int64_t left_in_store = 0) {
  for (bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "rows read in place" : "rows copied");
    KvStoreConfig sc;
    sc.capacity_bytes = 64 << 20;
    sc.shared_memory = false;
    auto store = KvStore::Create(sc);
    ASSERT_TRUE(store.ok()) << store.status();
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = store->get();
    auto client = MakeKvStoreClient(cc);
    ASSERT_TRUE(client.ok()) << client.status();
    testing::FaultyKvClient faulty(**client);
    StoreKvCacheOptions options;
    options.id_base = 5000;
    options.read_in_place = in_place;
    options.fetch_timeout = fetch_timeout;
    StoreKvCache cache(*l.backend, l.model->kv_shape(), faulty, options);
    EngineConfig config;
    config.max_running = 8;
    constexpr int kRequests = 8, kLost = 3;
    std::vector<std::vector<int32_t>> prompts;
    std::vector<Collector> got(kRequests);
    absl::Notification submitted;
    std::atomic<uint64_t> lost_id{0};
    {
      BatchEngine engine(*l.model, cache, config);
      for (int i = 0; i < kRequests; ++i) {
        prompts.push_back(RandomTokens(6 + 5 * i, vocab, 60 + i));
        EngineRequest r;
        r.prompt = prompts[i];
        r.options = t.Options(i);
        EventSink sink = got[i].Sink();
        if (i == kLost) {  // on the engine thread, between two steps
          sink = [&, inner = std::move(sink)](const EngineEvent& e) {
            inner(e);
            absl::MutexLock lock(&got[kLost].mu);
            if (got[kLost].tokens.size() == 3 && !e.done) {
              submitted.WaitForNotification();
              inject(**store, faulty, cache.StoreId(lost_id.load()));
            }
          };
        }
        auto id = engine.Submit(std::move(r), std::move(sink));
        ASSERT_TRUE(id.ok()) << id.status();
        if (i == kLost) lost_id = *id;
      }
      submitted.Notify();
      for (int i = 0; i < kRequests; ++i) {
        ASSERT_TRUE(got[i].done.WaitForNotificationWithTimeout(absl::Seconds(60)));
      }
    }
    if (through_faulty) EXPECT_GT(faulty.injected(), 0) << "the fault was never hit";
    faulty.Heal();
    const std::vector<int32_t> lost_alone = t.Alone(prompts[kLost], t.Options(kLost));
    EXPECT_EQ(got[kLost].last.status.code(), want) << got[kLost].last.status;
    EXPECT_NE(got[kLost].last.status.message().find("KV cache"), std::string::npos)
        << got[kLost].last.status;
    ASSERT_GE(got[kLost].tokens.size(), 3u);
    EXPECT_LT(got[kLost].tokens.size(), lost_alone.size());
    EXPECT_TRUE(std::equal(got[kLost].tokens.begin(), got[kLost].tokens.end(), lost_alone.begin()));
    for (int i = 0; i < kRequests; ++i) {
      if (i == kLost) continue;
      EXPECT_TRUE(got[i].last.status.ok()) << "request " << i << ": " << got[i].last.status;
      EXPECT_EQ(got[i].tokens, t.Alone(prompts[i], t.Options(i))) << "request " << i;
    }
    EXPECT_EQ((*store)->Stats().sequences, left_in_store);
  }
}

// The store loses the sequence (closed behind the worker's back, as when its lease lapses):
// ABORTED, which the router resumes or replays.
TEST_F(Engine, ASequenceLostInTheStoreFailsAloneNotItsBatch) {
  ExpectAFaultFailsItsSequenceAlone(
      *this, l_, vocab_,
      [](KvStore& store, testing::FaultyKvClient&, StoreSequenceId id) {
        ASSERT_TRUE(store.Close(id).ok());
      },
      absl::StatusCode::kAborted, /*through_faulty=*/false);
}

// Its gathers fail (one layer's gather carries every sequence of the batch: the batch's gather
// fails as a whole, and each sequence's rows are then gathered alone).
TEST_F(Engine, ASequenceWhoseGathersFailFailsAloneNotItsBatch) {
  ExpectAFaultFailsItsSequenceAlone(
      *this, l_, vocab_,
      [](KvStore&, testing::FaultyKvClient& faulty, StoreSequenceId id) {
        faulty.Fail(testing::FaultyKvClient::Op::kGather, id,
                    absl::InternalError("injected gather failure"));
      },
      absl::StatusCode::kInternal);
}

// Its gathers stall (the store does not answer them within the fetch timeout). The batch's
// gather of a layer then times out as a whole: every sequence of it gathers again alone, at
// once, and only the stalled one times out again: ABORTED, for the router to resume elsewhere
// (its store sequence is released, not closed).
TEST_F(Engine, ASequenceWhoseGathersStallFailsAloneNotItsBatch) {
  ExpectAFaultFailsItsSequenceAlone(
      *this, l_, vocab_,
      [](KvStore&, testing::FaultyKvClient& faulty, StoreSequenceId id) {
        faulty.Stall(id, absl::Seconds(1));
      },
      absl::StatusCode::kAborted, /*through_faulty=*/true, absl::Milliseconds(300),
      /*left_in_store=*/1);  // released, its rows intact, for the next worker to take over
}

// Its appends fail (write-behind: the failure shows when its missing rows are gathered, with
// the append's code and message).
TEST_F(Engine, ASequenceWhoseAppendsFailFailsAloneNotItsBatch) {
  ExpectAFaultFailsItsSequenceAlone(
      *this, l_, vocab_,
      [](KvStore&, testing::FaultyKvClient& faulty, StoreSequenceId id) {
        faulty.Fail(testing::FaultyKvClient::Op::kAppend, id,
                    absl::ResourceExhaustedError("injected: the store is full"));
      },
      absl::StatusCode::kResourceExhausted);
}

// A request whose KV the store cannot serve for a while (UNAVAILABLE: a link down) fails, but
// its stored KV is released, not deleted: another worker can take it over (the router resumes
// the stream) until its lease ends. A request that fails on its own (INTERNAL) deletes it.
TEST_F(Engine, AStreamFailedForWantOfItsStoreLeavesItsKvForTheNextWorker) {
  for (absl::StatusCode fault : {absl::StatusCode::kUnavailable, absl::StatusCode::kInternal}) {
    SCOPED_TRACE(absl::StatusCodeToString(fault));
    KvStoreConfig sc;
    sc.capacity_bytes = 64 << 20;
    sc.shared_memory = false;
    auto store = KvStore::Create(sc);
    ASSERT_TRUE(store.ok()) << store.status();
    KvClientConfig cc;
    cc.transport = KvClientConfig::Transport::kInProcess;
    cc.store = store->get();
    auto client = MakeKvStoreClient(cc);
    ASSERT_TRUE(client.ok()) << client.status();
    testing::FaultyKvClient faulty(**client);
    StoreKvCacheOptions options;
    options.id_base = 7000;
    StoreKvCache cache(*l_.backend, l_.model->kv_shape(), faulty, options);
    const std::vector<int32_t> prompt = RandomTokens(9, vocab_, 91);
    Collector got;
    std::atomic<uint64_t> id{0};
    absl::Notification submitted;
    StoreSequenceId home = 0;
    {
      BatchEngine engine(*l_.model, cache, EngineConfig());
      EngineRequest r;
      r.prompt = prompt;
      r.options = Options(0);
      EventSink sink = [&, inner = got.Sink()](const EngineEvent& e) {
        inner(e);
        absl::MutexLock lock(&got.mu);
        if (got.tokens.size() == 3 && !e.done) {
          submitted.WaitForNotification();
          home = cache.StoreId(id.load());
          faulty.Fail(testing::FaultyKvClient::Op::kGather, home,
                      absl::Status(fault, "injected: the store cannot be reached"));
        }
      };
      auto submitted_id = engine.Submit(std::move(r), sink);
      ASSERT_TRUE(submitted_id.ok()) << submitted_id.status();
      id = *submitted_id;
      submitted.Notify();
      ASSERT_TRUE(got.done.WaitForNotificationWithTimeout(absl::Seconds(60)));
    }
    EXPECT_EQ(got.last.status.code(), fault) << got.last.status;
    if (fault == absl::StatusCode::kInternal) {
      EXPECT_EQ((*store)->Stats().sequences, 0) << "a request's own failure frees its KV";
      continue;
    }
    ASSERT_EQ((*store)->Stats().sequences, 1) << "the released sequence waits for a new owner";
    EXPECT_EQ((*store)->Renew(cc.owner, absl::Now()), 0) << "no longer this worker's";
    SequenceSpec spec = *(*store)->Spec(home);
    spec.owner = "worker-b";
    auto kept = (*store)->Attach(home, home + 1, spec, 1 << 20, absl::Now());
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_GE(*kept, static_cast<int64_t>(prompt.size())) << "the prompt's rows are there";
  }
}

}  // namespace
}  // namespace infinigen
