// The router's failover rules (router/relay.h) as timeline tables: each step feeds the state
// machine one event and names the action it must answer (its DebugString; a pick also lists the
// workers it excludes). Then RunRelay (router/relay_driver.h) over scripted fake workers: what
// the client receives and what each worker was asked.
#include "router/relay.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "router/relay_driver.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

struct Event {
  enum class Kind { kStart, kPicked, kWaited, kReceived, kEnded, kClientGone };
  Kind kind = Kind::kStart;
  double at_s = 0;              // seconds after the start (kPicked, kEnded)
  std::string worker;           // kPicked ("": none available)
  std::vector<int32_t> tokens;  // kReceived
  uint64_t store = 0;
  bool attached = false;
  bool last = false;
  absl::Status status;  // kEnded
  bool stalled = false;
};

Event Start() { return {}; }
Event Picked(std::string w, double at_s = 0) {
  Event e;
  e.kind = Event::Kind::kPicked;
  e.worker = std::move(w);
  e.at_s = at_s;
  return e;
}
Event NoWorker(double at_s = 0) { return Picked("", at_s); }
Event Waited() {
  Event e;
  e.kind = Event::Kind::kWaited;
  return e;
}
Event Got(std::vector<int32_t> tokens, uint64_t store = 0, bool attached = false) {
  Event e;
  e.kind = Event::Kind::kReceived;
  e.tokens = std::move(tokens);
  e.store = store;
  e.attached = attached;
  return e;
}
Event Last(std::vector<int32_t> tokens) {
  Event e = Got(std::move(tokens));
  e.last = true;
  return e;
}
Event Ended(absl::Status s, double at_s = 0) {
  Event e;
  e.kind = Event::Kind::kEnded;
  e.status = std::move(s);
  e.at_s = at_s;
  return e;
}
Event Stalled(double at_s = 0) {
  Event e = Ended(absl::CancelledError("Cancelled"), at_s);
  e.stalled = true;
  return e;
}
Event Gone() {
  Event e;
  e.kind = Event::Kind::kClientGone;
  return e;
}

struct Step {
  const char* what;
  Event event;
  const char* expect;
};

wv1::GenerateRequest Request() {
  wv1::GenerateRequest r;
  r.set_request_id("req-1");
  r.set_text("hello");
  r.mutable_sampling()->set_seed(42);
  return r;
}

std::string Observe(Relay& relay, const RelayAction& a) {
  std::string s = a.DebugString();
  if (a.kind == RelayAction::Kind::kPick && !relay.excluded().empty()) {
    s += " [excluding " + absl::StrJoin(relay.excluded(), ",") + "]";
  }
  return s;
}

// Feeds `steps` to `relay` and checks each answer.
void Play(Relay& relay, const std::vector<Step>& steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    const Event& e = step.event;
    const absl::Time now = kT0 + absl::Seconds(e.at_s);
    std::string got;
    switch (e.kind) {
      case Event::Kind::kStart:
        got = Observe(relay, relay.Start());
        break;
      case Event::Kind::kPicked:
        got = Observe(relay, relay.Picked(e.worker, now));
        break;
      case Event::Kind::kWaited:
        got = Observe(relay, relay.Waited());
        break;
      case Event::Kind::kReceived: {
        wv1::GenerateResponse m;
        for (int32_t t : e.tokens) m.add_token_ids(t);
        m.set_store_sequence_id(e.store);
        m.set_attached(e.attached);
        if (e.last) m.set_finish_reason(v1::FINISH_REASON_LENGTH);
        got = relay.Received(std::move(m)).DebugString();
        break;
      }
      case Event::Kind::kEnded:
        got = Observe(relay, relay.Ended(e.status, e.stalled, now));
        break;
      case Event::Kind::kClientGone:
        got = Observe(relay, relay.ClientGone());
        break;
    }
    EXPECT_EQ(got, step.expect) << "step " << i + 1 << ": " << step.what;
  }
}

void RunTimeline(const RelayRules& rules, const std::vector<Step>& steps,
                 double client_deadline_s = 3600) {
  Relay relay(rules, Request(), /*budget=*/16, kT0 + absl::Seconds(client_deadline_s));
  Play(relay, steps);
}

TEST(RelayTimeline, AStreamWithoutFailures) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"two tokens", Got({5, 6}, 7), "forward 2 tokens (id, first)"},
                      {"the last", Last({8}), "forward 1 token (final: failovers 0, resumes 0)"},
                      {"w1 ends the call", Ended(absl::OkStatus()), "finish OK"},
                  });
}

TEST(RelayTimeline, AWorkerKilledMidStreamIsResumedFromTheStore) {
  Relay relay({}, Request(), 16, absl::InfiniteFuture());
  Play(relay, {
                  {"start", Start(), "pick"},
                  {"placed on w1", Picked("w1"), "call w1"},
                  {"two tokens, home 7", Got({5, 6}, 7), "forward 2 tokens (id, first)"},
                  {"w1 dies", Ended(absl::UnavailableError("Socket closed")),
                   "pick (w1 failed, failover) [excluding w1]"},
                  {"w2 takes it", Picked("w2"), "call w2 (resume 2 tokens, store 7)"},
                  {"w2 attached", Got({9}, 7, /*attached=*/true), "forward 1 token (resumed)"},
                  {"the last", Last({10}), "forward 1 token (final: failovers 1, resumes 1)"},
                  {"done", Ended(absl::OkStatus()), "finish OK"},
              });
  EXPECT_EQ(relay.sent(), (std::vector<int32_t>{5, 6, 9, 10}));
  EXPECT_EQ(relay.request().resume_token_ids_size(), 2);
  EXPECT_EQ(relay.request().sampling().seed(), 42u) << "every worker keeps the stream's seed";
}

TEST(RelayTimeline, WithoutResumeTheNextWorkerReplays) {
  RelayRules rules;
  rules.resume_from_store = false;
  RunTimeline(rules, {
                         {"start", Start(), "pick"},
                         {"placed on w1", Picked("w1"), "call w1"},
                         {"a token, home 7", Got({5}, 7), "forward 1 token (id, first)"},
                         {"w1 dies", Ended(absl::InternalError("boom")),
                          "pick (w1 failed, failover) [excluding w1]"},
                         {"w2: tokens but no store", Picked("w2"), "call w2 (resume 1 token)"},
                     });
}

TEST(RelayTimeline, AFrozenWorkerBeforeTheFirstTokenIsReplacedTransparently) {
  RunTimeline(
      {}, {
              {"start", Start(), "pick"},
              {"placed on w1", Picked("w1"), "call w1"},
              {"the watchdog cancels w1", Stalled(2), "pick (w1 failed, stalled) [excluding w1]"},
              {"w2, from the prompt", Picked("w2", 2), "call w2"},
              {"first tokens", Got({5}), "forward 1 token (id, first)"},
              {"the last", Last({6}), "forward 1 token (final: failovers 0, resumes 0)"},
          });
}

// A request of several samples (sampling.n > 1) killed mid-stream: the next worker gets each
// sample's own tokens and store sequence (resumed_samples), a sample that had ended is listed as
// finished, one that sent nothing is left out (it starts afresh); each sample's last message
// says its index and its seed (the request's + index).
TEST(RelayTimeline, SeveralSamplesResumeEachFromItsOwnTokens) {
  wv1::GenerateRequest r = Request();
  r.mutable_sampling()->set_n(3);
  Relay relay({}, r, 16, absl::InfiniteFuture());
  Play(relay, {
                  {"start", Start(), "pick"},
                  {"placed on w1", Picked("w1"), "call w1"},
                  {"w1 dies before a message", Ended(absl::UnavailableError("Socket closed")),
                   "pick (w1 failed) [excluding w1]"},
                  {"w2 takes it", Picked("w2"), "call w2"},
              });
  auto message = [](int index, std::vector<int32_t> tokens, uint64_t store, bool last) {
    wv1::GenerateResponse m;
    m.set_index(index);
    for (int32_t t : tokens) m.add_token_ids(t);
    m.set_store_sequence_id(store);
    if (last) m.set_finish_reason(v1::FINISH_REASON_LENGTH);
    return m;
  };
  relay.Received(message(0, {5, 6}, 70, false));
  const RelayForward last = relay.Received(message(2, {9}, 72, true));
  EXPECT_EQ(last.message.index(), 2);
  EXPECT_EQ(last.message.seed(), 44u);
  relay.Received(message(0, {7}, 0, false));
  Play(relay, {
                  {"w2 dies", Ended(absl::UnavailableError("Socket closed")),
                   "pick (w2 failed, failover) [excluding w1,w2]"},
                  {"w3 continues", Picked("w3"), "call w3 (resume 4 tokens)"},
              });
  const wv1::GenerateRequest& next = relay.request();
  EXPECT_EQ(next.resume_token_ids_size(), 0);
  ASSERT_EQ(next.resumed_samples_size(), 2) << "sample 1 sent nothing: it starts afresh";
  EXPECT_EQ(next.resumed_samples(0).index(), 0);
  EXPECT_EQ(std::vector<int32_t>(next.resumed_samples(0).token_ids().begin(),
                                 next.resumed_samples(0).token_ids().end()),
            (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(next.resumed_samples(0).store_sequence_id(), 70u);
  EXPECT_FALSE(next.resumed_samples(0).finished());
  EXPECT_EQ(next.resumed_samples(1).index(), 2);
  EXPECT_EQ(next.resumed_samples(1).store_sequence_id(), 72u);
  EXPECT_TRUE(next.resumed_samples(1).finished());
}

TEST(RelayTimeline, TheRequestsOwnErrorsGoToTheClientAsTheyAre) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"bad input", Ended(absl::InvalidArgumentError("prompt too long")),
                       "finish INVALID_ARGUMENT: prompt too long"},
                  });
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"a token", Got({5}), "forward 1 token (id, first)"},
                      {"deadline", Ended(absl::DeadlineExceededError("Deadline Exceeded")),
                       "finish DEADLINE_EXCEEDED: Deadline Exceeded"},
                  });
}

TEST(RelayTimeline, EveryWorkerFullBeforeAnyTokenIsRefusedWithAPushback) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"w1 is full", Ended(absl::ResourceExhaustedError("queue full")),
                       "pick [excluding w1]"},
                      {"w2", Picked("w2"), "call w2"},
                      {"w2 is full", Ended(absl::ResourceExhaustedError("queue full")),
                       "pick [excluding w1,w2]"},
                      {"no other", NoWorker(),
                       "finish RESOURCE_EXHAUSTED: every worker is full; retry after a short wait "
                       "(retry in 200 ms)"},
                  });
}

TEST(RelayTimeline, AStreamUnderWayWaitsForAWorkerUntilTheResumeWait) {
  RelayRules rules;
  rules.resume_wait = absl::Seconds(10);
  rules.max_attempts = 8;
  RunTimeline(
      rules,
      {
          {"start", Start(), "pick"},
          {"placed on w1", Picked("w1"), "call w1"},
          {"three tokens", Got({1, 2, 3}, 7), "forward 3 tokens (id, first)"},
          {"w1 dies at 1 s", Ended(absl::UnavailableError("gone"), 1),
           "pick (w1 failed, failover) [excluding w1]"},
          {"w2", Picked("w2", 1), "call w2 (resume 3 tokens, store 7)"},
          {"w2 is full: not a failover", Ended(absl::ResourceExhaustedError("full"), 1),
           "pick [excluding w1,w2]"},
          {"none available", NoWorker(1), "wait 100ms"},
          {"failed and full ones may be back", Waited(), "pick"},
          {"w1 is back at 2 s", Picked("w1", 2), "call w1 (resume 3 tokens, store 7)"},
          {"and fails again at 3 s", Ended(absl::UnavailableError("store unreachable"), 3),
           "pick (w1 failed, failover) [excluding w1]"},
          {"none at 10.9 s", NoWorker(10.9), "wait 100ms"},
          {"", Waited(), "pick"},
          {"none at 11 s: the resume wait (from the first failover) is over", NoWorker(11),
           "finish UNAVAILABLE: no worker could serve the request after 3 tokens were sent (3 "
           "worker calls; last error: store unreachable)"},
      });
}

// A prompt-only request (max_new_tokens 0) whose first message (its prompt logprobs, no token)
// reached the client is under way: its worker's failure is a failover, and with every worker full
// it waits instead of being refused as not started.
TEST(RelayTimeline, APromptOnlyStreamIsUnderWayOnceItsFirstMessageWasSent) {
  RelayRules rules;
  rules.resume_wait = absl::Seconds(10);
  Relay relay(rules, Request(), /*budget=*/0, kT0 + absl::Seconds(3600));
  Play(relay, {
                  {"start", Start(), "pick"},
                  {"placed on w1", Picked("w1"), "call w1"},
                  {"the prompt's message", Got({}, 7), "forward 0 tokens (id)"},
                  {"w1 dies", Ended(absl::UnavailableError("gone"), 1),
                   "pick (w1 failed, failover) [excluding w1]"},
                  {"w2 is full", Picked("w2", 1), "call w2"},
                  {"", Ended(absl::ResourceExhaustedError("full"), 1), "pick [excluding w1,w2]"},
                  {"none: it waits", NoWorker(1), "wait 100ms"},
              });
}

TEST(RelayTimeline, AStreamWhoseWorkersAllFailedResumesOnOneThatCameBack) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"two tokens", Got({1, 2}, 4), "forward 2 tokens (id, first)"},
                      {"w1 fails", Ended(absl::UnavailableError("x"), 1),
                       "pick (w1 failed, failover) [excluding w1]"},
                      {"the only worker", NoWorker(1), "wait 100ms"},
                      {"", Waited(), "pick"},
                      {"restarted", Picked("w1", 1.5), "call w1 (resume 2 tokens, store 4)"},
                      {"it took the KV over", Got({3}, 4, true), "forward 1 token (resumed)"},
                  });
}

TEST(RelayTimeline, MaxAttemptsBoundsTheCallsOfAStreamThatKeepsFailingWorkers) {
  RelayRules rules;
  rules.max_attempts = 2;
  RunTimeline(rules, {
                         {"start", Start(), "pick"},
                         {"placed on w1", Picked("w1"), "call w1"},
                         {"a token", Got({1}), "forward 1 token (id, first)"},
                         {"w1 fails", Ended(absl::InternalError("crash"), 1),
                          "pick (w1 failed, failover) [excluding w1]"},
                         {"no other", NoWorker(1), "wait 100ms"},
                         {"", Waited(), "pick"},
                         {"w1 again", Picked("w1", 2), "call w1 (resume 1 token)"},
                         {"fails again: the last attempt", Ended(absl::InternalError("crash"), 2),
                          "finish UNAVAILABLE: no worker could serve the request after 1 tokens "
                          "were sent (2 worker calls; last error: crash) (w1 failed)"},
                     });
}

TEST(RelayTimeline, AStreamWaitsNoLongerThanTheClientsDeadline) {
  RunTimeline(
      {},
      {
          {"start", Start(), "pick"},
          {"placed on w1", Picked("w1"), "call w1"},
          {"a token", Got({1}), "forward 1 token (id, first)"},
          {"w1 is full?!", Ended(absl::ResourceExhaustedError("full"), 1), "pick [excluding w1]"},
          {"none at 2 s, the deadline", NoWorker(2),
           "finish UNAVAILABLE: no worker could serve the request after 1 tokens were "
           "sent (1 worker call; last error: full)"},
      },
      /*client_deadline_s=*/2);
}

TEST(RelayTimeline, GivesUpAfterMaxAttemptsFailedCalls) {
  RelayRules rules;
  rules.max_attempts = 2;
  RunTimeline(
      rules, {
                 {"start", Start(), "pick"},
                 {"placed on w1", Picked("w1"), "call w1"},
                 {"w1 dies", Ended(absl::UnavailableError("a")), "pick (w1 failed) [excluding w1]"},
                 {"w2", Picked("w2"), "call w2"},
                 {"w2 dies: the last attempt", Ended(absl::UnknownError("b")),
                  "finish UNAVAILABLE: no worker could serve the request (2 worker calls; last "
                  "error: b) (w2 failed)"},
             });
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"no worker at all", NoWorker(),
                       "finish UNAVAILABLE: no worker could serve the request (0 worker calls; "
                       "last error: no worker is available)"},
                  });
}

TEST(RelayTimeline, TheClientLeaving) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"a token", Got({1}), "forward 1 token (id, first)"},
                      {"the client cancels", Gone(), "finish CANCELLED: the client cancelled"},
                  });
}

TEST(RelayTimeline, TheHomeIsTheLastWorkersAndTheIdGoesOnTheFirstMessageOnly) {
  RunTimeline({}, {
                      {"start", Start(), "pick"},
                      {"placed on w1", Picked("w1"), "call w1"},
                      {"no tokens yet, home 3", Got({}, 3), "forward 0 tokens (id)"},
                      {"first tokens", Got({1}), "forward 1 token (first)"},
                      {"w1 dies", Ended(absl::AbortedError("x")),
                       "pick (w1 failed, failover) [excluding w1]"},
                      {"w2 resumes from 3", Picked("w2"), "call w2 (resume 1 token, store 3)"},
                      {"w2 recomputed into 4", Got({2}, 4), "forward 1 token"},
                      {"w2 dies", Ended(absl::AbortedError("y")),
                       "pick (w2 failed, failover) [excluding w1,w2]"},
                      {"w3 resumes from 4", Picked("w3"), "call w3 (resume 2 tokens, store 4)"},
                  });
}

// RunRelay over fake workers, each with a script: the messages it sends, then how its call ends.
struct Script {
  std::vector<wv1::GenerateResponse> messages;
  absl::Status end;
  bool stalled = false;
};

class FakeCall final : public WorkerCall {
 public:
  FakeCall(const Script& script, bool* cancelled) : script_(script), cancelled_(cancelled) {}
  bool Read(wv1::GenerateResponse* m) override {
    if (*cancelled_ || next_ == script_.messages.size()) return false;
    *m = script_.messages[next_++];
    return true;
  }
  void Cancel() override { *cancelled_ = true; }
  absl::Status Finish() override {
    return *cancelled_ ? absl::CancelledError("cancelled") : script_.end;
  }
  bool stalled() const override { return script_.stalled; }

 private:
  const Script& script_;
  bool* cancelled_;
  size_t next_ = 0;
};

class FakeWorkers final : public WorkerClient {
 public:
  std::map<std::string, Script> scripts;  // placement: the first not excluded, by name
  std::vector<std::pair<std::string, wv1::GenerateRequest>> calls;
  std::vector<std::string> failures;
  std::map<std::string, bool> cancelled;

  std::string Pick(absl::string_view, const std::vector<std::string>& excluded) override {
    for (const auto& [name, script] : scripts) {
      if (std::find(excluded.begin(), excluded.end(), name) == excluded.end()) return name;
    }
    return "";
  }
  std::unique_ptr<WorkerCall> Call(absl::string_view worker, const wv1::GenerateRequest& request,
                                   int64_t) override {
    calls.emplace_back(std::string(worker), request);
    return std::make_unique<FakeCall>(scripts.at(std::string(worker)),
                                      &cancelled[std::string(worker)]);
  }
  void ReportFailure(absl::string_view worker) override { failures.emplace_back(worker); }
};

class FakeClient final : public ClientStream {
 public:
  int accept = 1 << 30;  // messages it reads before going away
  std::vector<v1::GenerateResponse> received;
  bool Write(const v1::GenerateResponse& m) override {
    if (static_cast<int>(received.size()) >= accept) return false;
    received.push_back(m);
    return true;
  }
  bool Cancelled() override { return static_cast<int>(received.size()) >= accept; }
};

wv1::GenerateResponse Message(std::vector<int32_t> tokens, uint64_t store = 0,
                              bool attached = false, bool last = false) {
  wv1::GenerateResponse m;
  for (int32_t t : tokens) m.add_token_ids(t);
  m.set_store_sequence_id(store);
  m.set_attached(attached);
  if (last) m.set_finish_reason(v1::FINISH_REASON_STOP);
  return m;
}

std::vector<int32_t> Tokens(const std::vector<v1::GenerateResponse>& messages) {
  std::vector<int32_t> out;
  for (const auto& m : messages) out.insert(out.end(), m.token_ids().begin(), m.token_ids().end());
  return out;
}

TEST(RunRelay, AKilledWorkersStreamContinuesOnAnotherFromItsStoredKv) {
  FakeWorkers workers;
  workers.scripts["w1"] = {{Message({1}, 11), Message({2}), Message({3})},
                           absl::UnavailableError("Socket closed")};
  workers.scripts["w2"] = {{Message({4}, 11, true), Message({5}, 0, false, true)},
                           absl::OkStatus()};
  FakeClient client;
  Relay relay({}, Request(), 16, absl::InfiniteFuture());
  const RelayAction end = RunRelay(relay, workers, client, "", nullptr, "req-1");
  EXPECT_TRUE(end.status.ok()) << end.status;
  EXPECT_EQ(Tokens(client.received), (std::vector<int32_t>{1, 2, 3, 4, 5}))
      << "every token once, in order";
  ASSERT_EQ(workers.calls.size(), 2u);
  EXPECT_EQ(workers.calls[0].second.resume_token_ids_size(), 0);
  const wv1::GenerateRequest& second = workers.calls[1].second;
  EXPECT_EQ(workers.calls[1].first, "w2");
  EXPECT_EQ(
      std::vector<int32_t>(second.resume_token_ids().begin(), second.resume_token_ids().end()),
      (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(second.resume_store_sequence_id(), 11u);
  EXPECT_EQ(workers.failures, (std::vector<std::string>{"w1"}));
  EXPECT_EQ(client.received.front().request_id(), "req-1");
  EXPECT_EQ(client.received.back().failovers(), 1);
  EXPECT_EQ(client.received.back().resumes(), 1);
  EXPECT_EQ(client.received.back().seed(), 42u);
}

TEST(RunRelay, TheClientLeavingCancelsTheWorkerCall) {
  FakeWorkers workers;
  workers.scripts["w1"] = {{Message({1}), Message({2}), Message({3})}, absl::OkStatus()};
  FakeClient client;
  client.accept = 1;
  Relay relay({}, Request(), 16, absl::InfiniteFuture());
  const RelayAction end = RunRelay(relay, workers, client, "", nullptr, "req-1");
  EXPECT_EQ(end.status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(workers.cancelled["w1"]);
  EXPECT_EQ(workers.calls.size(), 1u) << "no other worker is tried for a client that left";
  EXPECT_TRUE(workers.failures.empty()) << "the worker did nothing wrong";
}

TEST(RunRelay, AFullPoolRefusesARequestThatHasNotStarted) {
  FakeWorkers workers;
  workers.scripts["w1"] = {{}, absl::ResourceExhaustedError("queue full")};
  workers.scripts["w2"] = {{}, absl::ResourceExhaustedError("queue full")};
  FakeClient client;
  Relay relay({}, Request(), 16, absl::InfiniteFuture());
  const RelayAction end = RunRelay(relay, workers, client, "", nullptr, "req-1");
  EXPECT_EQ(end.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GT(end.retry_pushback_ms, 0);
  EXPECT_EQ(workers.calls.size(), 2u);
  EXPECT_TRUE(workers.failures.empty()) << "full workers stay in placement";
  EXPECT_TRUE(client.received.empty());
}

}  // namespace
}  // namespace infinigen
