// infinigen-router in front of two infinigen-worker processes sharing one infinigen-kvstore, all
// real processes on 127.0.0.1 with the tiny Llama 3.1 fixture: streams through the router equal
// a worker's own; kill -9 of a worker mid-stream leaves every client stream complete and
// correct (resumed on the other worker), and so does SIGSTOP (a frozen worker's streams move
// on while it is stopped); bad requests name the limit; API keys; queue full;
// deadlines; cancellation reaching the worker; a draining worker gets no new requests; TLS with
// mTLS between the services; and a bounded load with zero errors, through the router and
// through the all-in-one `infinigen serve`.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netdb.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/certificates.h"
#include "tests/support/fixture_model.h"
#include "tests/support/health_check.h"
#include "tests/support/http_get.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"
#include "tests/support/token_request.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;
using testing::FreePort;
using testing::MakeCertificates;
using testing::RandomTokens;
using testing::ReadFile;
using testing::ServerProcess;

const char* kModel = "hf/llama31_gqa";
constexpr int kVocab = 211;

std::string Addr(int port) { return "127.0.0.1:" + std::to_string(port); }

// Whether the resolver maps "localhost" to 127.0.0.1 (a minimal container may have no /etc/hosts).
bool LocalhostResolvesToLoopback() {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (getaddrinfo("localhost", nullptr, &hints, &found) != 0) return false;
  bool loopback = false;
  for (const addrinfo* a = found; a != nullptr && !loopback; a = a->ai_next) {
    loopback =
        reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr == htonl(INADDR_LOOPBACK);
  }
  freeaddrinfo(found);
  return loopback;
}

v1::GenerateRequest Request(const std::vector<int32_t>& prompt, int max_new, float temperature = 0,
                            uint64_t seed = 0) {
  v1::GenerateRequest r;
  testing::FillTokenRequest(r, prompt, max_new, temperature, seed);
  return r;
}

struct StreamResult {
  std::vector<int32_t> tokens;
  v1::GenerateResponse last;
  std::string request_id;
  grpc::Status status;
  std::multimap<grpc::string_ref, grpc::string_ref> trailers;
};

StreamResult Stream(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                    grpc::ClientContext* context = nullptr,
                    const std::function<void(int)>& on_token = {}) {
  grpc::ClientContext own;
  if (context == nullptr) {
    context = &own;
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  }
  StreamResult r;
  auto reader = stub.Generate(context, request);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (!msg.request_id().empty()) r.request_id = msg.request_id();
    for (int32_t t : msg.token_ids()) r.tokens.push_back(t);
    if (on_token && msg.token_ids_size() > 0) on_token(static_cast<int>(r.tokens.size()));
    r.last = msg;
  }
  r.status = reader->Finish();
  r.trailers = context->GetServerTrailingMetadata();
  return r;
}

std::unique_ptr<v1::Generation::Stub> PublicStub(int port) {
  return v1::Generation::NewStub(
      grpc::CreateChannel(Addr(port), grpc::InsecureChannelCredentials()));
}

// Requests streamed at once through the router, a thread each. AwaitStarted() waits (a second
// at most) until every stream has 3 tokens and says how many have; Join() waits for their ends.
// Each stream's longest gap between two of its messages is kept (longest_gap, seconds; from its
// first message on).
class ConcurrentStreams {
 public:
  ConcurrentStreams(v1::Generation::Stub& stub, const std::vector<v1::GenerateRequest>& requests)
      : got(requests.size()), longest_gap(requests.size(), 0.0) {
    for (size_t i = 0; i < requests.size(); ++i) {
      threads_.emplace_back([this, &stub, &requests, i] {
        bool counted = false, seen = false;
        auto last = std::chrono::steady_clock::now();
        got[i] = Stream(stub, requests[i], nullptr, [&](int n) {
          const auto now = std::chrono::steady_clock::now();
          if (seen) {  // gaps between messages, not the wait for the first
            longest_gap[i] =
                std::max(longest_gap[i], std::chrono::duration<double>(now - last).count());
          }
          seen = true;
          last = now;
          if (n >= 3 && !counted) {
            counted = true;
            started_.fetch_add(1);
          }
        });
      });
    }
  }
  ~ConcurrentStreams() { Join(); }
  int AwaitStarted() {
    for (int i = 0; i < 500 && started_.load() < static_cast<int>(got.size()); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return started_.load();
  }
  void Join() {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  std::vector<StreamResult> got;
  std::vector<double> longest_gap;

 private:
  std::atomic<int> started_{0};
  std::vector<std::thread> threads_;
};

class RouterProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    store_port_ = FreePort();
    store_ = std::make_unique<ServerProcess>(
        "infinigen-kvstore",
        std::vector<std::string>{"--listen=" + Addr(store_port_), "--capacity_mb=64",
                                 "--huge_pages=false"},
        store_port_);
    ASSERT_TRUE(store_->running());
    for (int i = 0; i < 2; ++i) {
      worker_ports_[i] = FreePort();
      workers_[i] =
          StartWorker(worker_ports_[i], {"--kv_transport=grpc", "--kv_store=" + Addr(store_port_)});
      ASSERT_TRUE(workers_[i]->running());
    }
    router_port_ = FreePort();
    router_metrics_port_ = FreePort();
    router_ = StartRouter(router_port_, {"--metrics_port=" + std::to_string(router_metrics_port_)});
    ASSERT_TRUE(router_->running());
    stub_ = PublicStub(router_port_);
    WaitForWorkers(*stub_, 2);
  }

  std::unique_ptr<ServerProcess> StartWorker(int port, std::vector<std::string> extra) {
    std::vector<std::string> args = {"--model=" + testing::FixturePath(kModel),
                                     "--listen=" + Addr(port),
                                     "--policy=full",
                                     "--threads=1",
                                     "--max_running=16",
                                     "--drain_seconds=5"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<ServerProcess>("infinigen-worker", args, port);
  }

  std::unique_ptr<ServerProcess> StartRouter(int port, std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "--listen=" + Addr(port),
        "--workers=" + Addr(worker_ports_[0]) + "," + Addr(worker_ports_[1]),
        "--health_interval_ms=200",
        "--max_prompt_tokens=200",
        "--max_new_tokens_limit=240",
        "--max_request_bytes=4096"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<ServerProcess>("infinigen-router", args, port);
  }

  // Until GetModelInfo counts `n` available workers.
  static void WaitForWorkers(v1::Generation::Stub& stub, int n, const std::string& key = "") {
    int seen = -1;
    for (int i = 0; i < 100 && seen != n; ++i) {
      grpc::ClientContext c;
      if (!key.empty()) c.AddMetadata("authorization", "Bearer " + key);
      v1::ModelInfo info;
      if (stub.GetModelInfo(&c, v1::GetModelInfoRequest(), &info).ok()) seen = info.workers();
      if (seen != n) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_EQ(seen, n) << "available workers";
  }

  // What one worker generates for the request, called directly.
  std::vector<int32_t> Direct(int worker, const v1::GenerateRequest& r) {
    auto stub = wv1::Worker::NewStub(
        grpc::CreateChannel(Addr(worker_ports_[worker]), grpc::InsecureChannelCredentials()));
    wv1::GenerateRequest w;
    *w.mutable_token_ids() = r.token_ids();
    *w.mutable_sampling() = r.sampling();
    *w.mutable_stopping() = r.stopping();
    grpc::ClientContext c;
    auto reader = stub->Generate(&c, w);
    wv1::GenerateResponse m;
    std::vector<int32_t> out;
    while (reader->Read(&m)) out.insert(out.end(), m.token_ids().begin(), m.token_ids().end());
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }

  int32_t WorkerRunning(int worker) {
    auto stub = wv1::Worker::NewStub(
        grpc::CreateChannel(Addr(worker_ports_[worker]), grpc::InsecureChannelCredentials()));
    grpc::ClientContext c;
    wv1::InfoResponse info;
    return stub->Info(&c, wv1::InfoRequest(), &info).ok() ? info.running() + info.queued() : -1;
  }

  int store_port_ = 0, router_port_ = 0, router_metrics_port_ = 0;
  int worker_ports_[2] = {0, 0};
  std::unique_ptr<ServerProcess> store_, router_;
  std::unique_ptr<ServerProcess> workers_[2];
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(RouterProcess, StreamsEqualAWorkersOwnAndCarryUsage) {
  for (int i = 0; i < 4; ++i) {
    const auto r =
        Request(RandomTokens(12 + 5 * i, kVocab, 20 + i), 30, i % 2 ? 0.8f : 0.0f, 5 + i);
    const StreamResult got = Stream(*stub_, r);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.tokens, Direct(i % 2, r)) << "request " << i;
    EXPECT_EQ(got.last.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(got.last.usage().generated_tokens(), 30);
    EXPECT_EQ(got.last.failovers(), 0);
    EXPECT_FALSE(got.request_id.empty()) << "the router names requests that come without an id";
  }
  v1::GenerateRequest named = Request({1, 2, 3}, 2);
  named.set_request_id("my-request");
  EXPECT_EQ(Stream(*stub_, named).request_id, "my-request");

  const testing::HttpReply metrics = testing::HttpGet(router_metrics_port_, "/metrics");
  ASSERT_EQ(metrics.code, 200);
  EXPECT_EQ(testing::MetricValue(metrics.body, "infinigen_router_tokens_total"), 4 * 30 + 2);
  EXPECT_NE(metrics.body.find("infinigen_router_requests_total{code=\"OK\"} 5"), std::string::npos)
      << metrics.body;
  EXPECT_EQ(testing::MetricValue(metrics.body, "infinigen_router_available_workers"), 2);
  EXPECT_EQ(testing::MetricValue(metrics.body, "infinigen_router_streams"), 0);
}

// A request without a seed gets one of its own (a fixed default would make every sampled
// answer to a prompt the same), reported on its last message; that seed reproduces the stream.
TEST_F(RouterProcess, UnseededRequestsDrawASeedAndReportIt) {
  v1::GenerateRequest r = Request(RandomTokens(10, kVocab, 77), 16, 1.0f);
  r.mutable_sampling()->clear_seed();
  const StreamResult a = Stream(*stub_, r), b = Stream(*stub_, r);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_NE(a.last.seed(), b.last.seed());
  v1::GenerateRequest again = r;
  again.mutable_sampling()->set_seed(a.last.seed());
  const StreamResult c = Stream(*stub_, again);
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_EQ(c.last.seed(), a.last.seed());
  EXPECT_EQ(c.tokens, a.tokens) << "the reported seed reproduces the stream";
}

// grpc.health.v1 on the router by the public service's name and "" (SERVING), an unknown
// name NOT_FOUND.
TEST_F(RouterProcess, HealthAnswersByServiceName) {
  testing::ExpectHealthByServiceName(Addr(router_port_), "infinigen.v1.Generation");
}

// One log line per request: its id, its end user, the outcome and what was streamed (never the
// prompt). The client's strings are escaped: a newline in them cannot forge a line.
TEST_F(RouterProcess, EachRequestIsLoggedByItsId) {
  v1::GenerateRequest r = Request({1, 2, 3}, 5);
  r.set_request_id("log-me-42");
  r.set_user("alice\nrequest forged: OK");
  ASSERT_TRUE(Stream(*stub_, r).status.ok());
  v1::GenerateRequest odd = Request({1, 2, 3}, 2);
  odd.set_request_id("log-me-\n44");
  ASSERT_TRUE(Stream(*stub_, odd).status.ok());
  v1::GenerateRequest bad = Request({1, 2, 3}, 5);
  bad.set_request_id("log-me-43");
  bad.mutable_sampling()->set_top_p(-1);
  EXPECT_FALSE(Stream(*stub_, bad).status.ok());
  bool logged = false;
  for (int i = 0; i < 50 && !logged; ++i) {
    logged = router_->Logged("request log-me-43: INVALID_ARGUMENT");
    if (!logged) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(
      router_->Logged("request log-me-42 user \"alice\\nrequest forged: OK\": OK, 5 tokens in "));
  EXPECT_TRUE(router_->Logged("request log-me-\\n44: OK, 2 tokens in "));
  EXPECT_FALSE(router_->Logged("\nrequest forged"));
  EXPECT_TRUE(logged);
}

// Half of the streams with OpenAI's penalties, which count every token generated before.
TEST_F(RouterProcess, KillingAWorkerMidStreamLosesNoStream) {
  constexpr int kStreams = 8, kNew = 220;
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<int32_t>> want;
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(
        Request(RandomTokens(8 + i, kVocab, 40 + i), kNew, i % 2 ? 0.9f : 0.0f, 100 + i));
    if (i >= kStreams / 2) {
      // Penalties count the tokens generated so far: a resumed stream counts the ones sent.
      const std::vector<int32_t> plain = Direct(1, requests.back());
      requests.back().mutable_sampling()->set_presence_penalty(0.4f);
      requests.back().mutable_sampling()->set_frequency_penalty(0.3f);
      want.push_back(Direct(1, requests.back()));
      EXPECT_NE(want.back(), plain) << "stream " << i << ": the penalties changed nothing";
    } else {
      want.push_back(Direct(1, requests.back()));
    }
  }
  ConcurrentStreams streams(*stub_, requests);
  // Once every stream is under way, worker 0 dies without a word.
  EXPECT_EQ(streams.AwaitStarted(), kStreams)
      << "streams should still be running when the worker dies";
  workers_[0]->Kill();
  streams.Join();
  const std::vector<StreamResult>& got = streams.got;
  int moved = 0, resumed = 0;
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << "stream " << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i << " lost, repeated or changed tokens";
    EXPECT_EQ(got[i].last.usage().generated_tokens(), kNew);
    moved += got[i].last.failovers();
    resumed += got[i].last.resumes();
  }
  EXPECT_GT(moved, 0) << "some streams ran on the killed worker";
  // The killed worker's sequences are still in the store (their lease has not lapsed): every
  // moved stream continued from its stored KV, none recomputed its prompt.
  EXPECT_EQ(resumed, moved);
  // New requests go to the survivor.
  EXPECT_TRUE(Stream(*stub_, Request({5, 6, 7}, 4)).status.ok());
}

// SIGSTOP of one worker while 8 streams run: its health probes time out, the router's
// watchdog finds its streams silent and moves them to the other worker, so every stream
// completes with exactly its tokens while the worker is still frozen (the stream does not wait
// for it; the client's deadline is far away), and GetModelInfo answers from the pool's state
// meanwhile. Continued afterwards, the worker serves again.
TEST_F(RouterProcess, AFrozenWorkersStreamsMoveOnAndModelInfoDoesNotWait) {
  constexpr int kStreams = 8, kNew = 220;
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<int32_t>> want;
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(
        Request(RandomTokens(9 + i, kVocab, 80 + i), kNew, i % 2 ? 0.9f : 0.0f, 300 + i));
    want.push_back(Direct(1, requests.back()));
  }
  std::vector<StreamResult> got(kStreams);
  std::atomic<int> started{0};
  std::atomic<bool> frozen{false};
  std::atomic<int> finished_while_frozen{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      bool counted = false;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      got[i] = Stream(*stub_, requests[i], &context, [&](int n) {
        if (n >= 3 && !counted) {
          counted = true;
          started.fetch_add(1);
        }
      });
      if (frozen.load()) finished_while_frozen.fetch_add(1);
    });
  }
  for (int i = 0; i < 500 && started.load() < kStreams; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(started.load(), kStreams) << "streams should still be running when the worker stops";
  frozen = true;
  workers_[0]->Signal(SIGSTOP);
  {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ModelInfo info;
    const grpc::Status s = stub_->GetModelInfo(&c, v1::GetModelInfoRequest(), &info);
    EXPECT_TRUE(s.ok()) << "GetModelInfo waited on the frozen worker: " << s.error_message();
    EXPECT_EQ(info.vocab_size(), kVocab);
  }
  for (auto& t : threads) t.join();
  const int while_frozen = finished_while_frozen.load();
  workers_[0]->Signal(SIGCONT);
  frozen = false;
  EXPECT_EQ(while_frozen, kStreams) << "every stream ended while the worker was still stopped";
  int moved = 0, resumed = 0;
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << "stream " << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i << " lost, repeated or changed tokens";
    moved += got[i].last.failovers();
    resumed += got[i].last.resumes();
  }
  EXPECT_GT(moved, 0) << "some streams ran on the frozen worker";
  EXPECT_EQ(resumed, moved) << "the frozen worker's sequences were taken over, not recomputed";
  EXPECT_TRUE(router_->Logged("stalled after")) << "the router logs each moved stream";
  WaitForWorkers(*stub_, 2);
}

// A worker that answers no health check for a moment (a pause of the process, every core busy)
// is not taken for dead: SIGSTOP for 1.6 s, in which one or two checks time out (800 ms each),
// moves none of its streams (they wait and go on there), whereas a check refused at once (a
// killed worker, above) or --health_misses checks in a row (3, the frozen worker above) would.
// With --health_misses=1 (the router before this rule) the streams on it moved.
TEST_F(RouterProcess, AWorkerPausedForAMomentKeepsItsStreams) {
  constexpr int kStreams = 6, kNew = 240;
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<int32_t>> want;
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(
        Request(RandomTokens(11 + i, kVocab, 30 + i), kNew, i % 2 ? 0.9f : 0.0f, 500 + i));
    want.push_back(Direct(1, requests.back()));
  }
  ConcurrentStreams streams(*stub_, requests);
  EXPECT_EQ(streams.AwaitStarted(), kStreams)
      << "streams should still be running when the worker pauses";
  workers_[0]->Signal(SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  workers_[0]->Signal(SIGCONT);
  streams.Join();
  const std::vector<StreamResult>& got = streams.got;
  int moved = 0, paused = 0;
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << "stream " << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i;
    moved += got[i].last.failovers();
    paused += streams.longest_gap[i] > 1.2;
  }
  EXPECT_GT(paused, 0) << "no stream was on the paused worker";
  EXPECT_EQ(moved, 0) << "a worker that missed a health check or two lost its streams";
  EXPECT_FALSE(router_->Logged("stalled after"));
}

TEST_F(RouterProcess, NoWorkerLeftIsUnavailable) {
  workers_[0]->Kill();
  workers_[1]->Kill();
  const StreamResult r = Stream(*stub_, Request({1, 2, 3}, 4));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  // A worker that comes back on its port is found again by the health checks.
  workers_[1] =
      StartWorker(worker_ports_[1], {"--kv_transport=grpc", "--kv_store=" + Addr(store_port_)});
  WaitForWorkers(*stub_, 1);
  EXPECT_TRUE(Stream(*stub_, Request({1, 2, 3}, 4)).status.ok());
}

TEST_F(RouterProcess, BadRequestsNameTheLimitAndTheRouterKeepsServing) {
  auto check = [&](const v1::GenerateRequest& r, const std::string& needle) {
    const grpc::Status s = Stream(*stub_, r).status;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << needle << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(needle), std::string::npos) << s.error_message();
  };
  check(v1::GenerateRequest(), "input");
  check(Request({1, 2}, 1000), "max_new_tokens_limit");
  check(Request(RandomTokens(201, kVocab, 1), 4), "max_prompt_tokens");
  v1::GenerateRequest large;
  large.set_text(std::string(5000, 'a'));
  check(large, "max_request_bytes");
  check(Request({1, 2, kVocab + 3}, 4), "vocabulary");  // found by the worker, passed through
  auto bad_p = Request({1, 2}, 4);
  bad_p.mutable_sampling()->set_top_p(-1);
  check(bad_p, "top_p");
  v1::GenerateRequest empty_text;
  empty_text.set_text("");
  check(empty_text, "empty");
  for (const char* role : {"", "admin", "User"}) {  // roles are checked, and case matters
    v1::GenerateRequest chat;
    auto* m = chat.mutable_messages()->add_messages();
    m->set_role("user");
    m->set_content("hi");
    m = chat.mutable_messages()->add_messages();
    m->set_role(role);
    m->set_content("hello");
    check(chat, "messages[1].role");
    check(chat, "system, user and assistant");
  }
  EXPECT_TRUE(Stream(*stub_, Request({1, 2, 3}, 4)).status.ok());
}

// Raw invalid UTF-8 in any string field of a request: INVALID_ARGUMENT naming the field (protobuf
// alone refuses the message and gRPC answers INTERNAL with no message), and the router goes on.
TEST_F(RouterProcess, InvalidUtf8IsNamedPerField) {
  const std::string bad = "ok \xff\xfe";  // 0xFF never occurs in UTF-8
  auto chat = [&](const std::string& role, const std::string& content) {
    v1::GenerateRequest r;
    auto* m = r.mutable_messages()->add_messages();
    m->set_role("user");
    m->set_content("hi");
    m = r.mutable_messages()->add_messages();
    m->set_role(role);
    m->set_content(content);
    return r;
  };
  std::vector<std::pair<v1::GenerateRequest, std::string>> cases;
  v1::GenerateRequest text;
  text.set_text(bad);
  cases.emplace_back(text, "text");
  cases.emplace_back(chat("user", bad), "messages.messages[1].content");
  cases.emplace_back(chat(bad, "x"), "messages.messages[1].role");
  v1::GenerateRequest stop = Request({1, 2, 3}, 4);
  stop.mutable_stopping()->add_stop_strings("fine");
  stop.mutable_stopping()->add_stop_strings(bad);
  cases.emplace_back(stop, "stopping.stop_strings[1]");
  v1::GenerateRequest session = Request({1, 2, 3}, 4);
  session.set_session_id(bad);
  cases.emplace_back(session, "session_id");
  v1::GenerateRequest policy = Request({1, 2, 3}, 4);
  policy.mutable_selection()->set_policy(bad);
  cases.emplace_back(policy, "selection.policy");
  v1::GenerateRequest id = Request({1, 2, 3}, 4);
  id.set_request_id(bad);
  cases.emplace_back(id, "request_id");
  for (const auto& [request, field] : cases) {
    const grpc::Status st = Stream(*stub_, request).status;
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << field << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(field + " is not valid UTF-8"), std::string::npos)
        << st.error_message();
  }
  grpc::ClientContext c;
  v1::TokenizeRequest t;
  t.set_text(bad);
  v1::TokenizeResponse out;
  const grpc::Status st = stub_->Tokenize(&c, t, &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("text is not valid UTF-8"), std::string::npos);
  for (const bool in_role : {false, true}) {  // Tokenize's chat messages, each string field
    grpc::ClientContext cm;
    v1::TokenizeRequest tm;
    auto* m = tm.mutable_messages()->add_messages();
    m->set_role(in_role ? bad : "user");
    m->set_content(in_role ? "hi" : bad);
    const grpc::Status s = stub_->Tokenize(&cm, tm, &out);
    const std::string field =
        in_role ? "messages.messages[0].role" : "messages.messages[0].content";
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(field + " is not valid UTF-8"), std::string::npos)
        << s.error_message();
  }
  EXPECT_TRUE(Stream(*stub_, Request({1, 2, 3}, 4)).status.ok());
  // Valid multi-byte text passes.
  v1::GenerateRequest fine = chat("user", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  fine.mutable_stopping()->set_max_new_tokens(2);
  const grpc::Status ok = Stream(*stub_, fine).status;
  EXPECT_NE(ok.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ok.error_message();
}

TEST_F(RouterProcess, ApiKeys) {
  const std::string keys = ::testing::TempDir() + "/router_keys.txt";
  std::ofstream(keys) << "# keys\nsecret-one\n\nsecret-two\n";
  const int port = FreePort();
  auto router = StartRouter(port, {"--api_keys_file=" + keys});
  ASSERT_TRUE(router->running());
  auto stub = PublicStub(port);
  WaitForWorkers(*stub, 2, "secret-two");
  auto with_key = [&](const std::string& header) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!header.empty()) c.AddMetadata("authorization", header);
    return Stream(*stub, Request({1, 2, 3}, 3), &c).status;
  };
  EXPECT_EQ(with_key("").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(with_key("Bearer secret-on").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(with_key("secret-one").error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(with_key("Bearer secret-one").ok());
  EXPECT_TRUE(with_key("Bearer secret-two").ok());
  EXPECT_TRUE(with_key("bearer secret-one").ok()) << "the scheme is case-insensitive";
  EXPECT_TRUE(with_key("BEARER secret-two").ok());
  EXPECT_EQ(with_key("Bearer SECRET-ONE").error_code(), grpc::StatusCode::UNAUTHENTICATED)
      << "the key is not";
  grpc::ClientContext c;
  v1::ModelInfo info;
  EXPECT_EQ(stub->GetModelInfo(&c, v1::GetModelInfoRequest(), &info).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Keys never reach the log.
  std::ifstream log(router->log_path());
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.find("secret"), std::string::npos);
  // Without --api_keys_file (the fixture's router) no key is needed.
  EXPECT_TRUE(Stream(*stub_, Request({1, 2, 3}, 3)).status.ok());
}

// Per-key limits (router/key_limits.h): a key with a stream in flight at
// --max_streams_per_key=1 is refused a second one while another key is served; a key past its
// rate (--requests_per_second_per_key, bursts of --request_burst_per_key) is refused
// RESOURCE_EXHAUSTED naming the limit, with the wait in grpc-retry-pushback-ms.
TEST_F(RouterProcess, PerKeyLimits) {
  const std::string keys = ::testing::TempDir() + "/router_limited_keys.txt";
  std::ofstream(keys) << "key-one\nkey-two\n";
  const int port = FreePort();
  auto router =
      StartRouter(port, {"--api_keys_file=" + keys, "--max_streams_per_key=1",
                         "--requests_per_second_per_key=0.05", "--request_burst_per_key=2"});
  ASSERT_TRUE(router->running());
  auto stub = PublicStub(port);
  WaitForWorkers(*stub, 2, "key-two");
  auto context = [](grpc::ClientContext& c, const std::string& key) {
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    c.AddMetadata("authorization", "Bearer " + key);
  };
  grpc::Status second_same, other_key;
  grpc::ClientContext first_context;
  context(first_context, "key-one");
  const StreamResult first = Stream(*stub, Request({1, 2, 3}, 40), &first_context, [&](int n) {
    if (n != 1) return;
    grpc::ClientContext a, b;
    context(a, "key-one");
    second_same = Stream(*stub, Request({4, 5, 6}, 3), &a).status;
    context(b, "key-two");
    other_key = Stream(*stub, Request({4, 5, 6}, 3), &b).status;
  });
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(second_same.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << second_same.error_message();
  EXPECT_NE(second_same.error_message().find("max_streams_per_key"), std::string::npos);
  EXPECT_TRUE(other_key.ok()) << other_key.error_message();
  // key-one has used 1 of its burst of 2 (the refused request took none); one more passes, the
  // next is refused for its rate (one request per 20 s).
  grpc::ClientContext third_context, fourth_context;
  context(third_context, "key-one");
  EXPECT_TRUE(Stream(*stub, Request({1, 2, 3}, 2), &third_context).status.ok());
  context(fourth_context, "key-one");
  const grpc::Status fourth = Stream(*stub, Request({1, 2, 3}, 2), &fourth_context).status;
  EXPECT_EQ(fourth.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << fourth.error_message();
  EXPECT_NE(fourth.error_message().find("requests_per_second_per_key"), std::string::npos)
      << fourth.error_message();
  const auto& trailers = fourth_context.GetServerTrailingMetadata();
  auto pushback = trailers.find("grpc-retry-pushback-ms");
  ASSERT_NE(pushback, trailers.end());
  EXPECT_GT(std::stoi(std::string(pushback->second.data(), pushback->second.size())), 1000);
}

TEST_F(RouterProcess, AFullQueueIsResourceExhaustedAndDeadlinesAreHonoured) {
  const int port = FreePort();
  auto router = StartRouter(port, {"--max_streams=1", "--max_queued=1"});
  ASSERT_TRUE(router->running());
  auto stub = PublicStub(port);
  WaitForWorkers(*stub, 2);
  StreamResult queued_result, refused, late;
  std::thread queued;
  const StreamResult first = Stream(*stub, Request({1, 2, 3}, 230), nullptr, [&](int n) {
    if (n != 1) return;
    // The second waits in the queue; the third finds it full; a fourth with a short deadline...
    queued = std::thread([&] { queued_result = Stream(*stub, Request({4, 5, 6}, 3)); });
    for (int i = 0; i < 200; ++i) {
      grpc::ClientContext c;
      v1::ModelInfo info;
      if (stub->GetModelInfo(&c, v1::GetModelInfoRequest(), &info).ok() && info.queued() == 1)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    refused = Stream(*stub, Request({7, 8, 9}, 3));
  });
  queued.join();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_TRUE(queued_result.status.ok()) << queued_result.status.error_message();
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  auto it = refused.trailers.find("grpc-retry-pushback-ms");
  EXPECT_NE(it, refused.trailers.end()) << "a retry hint";

  // A deadline shorter than the generation: DEADLINE_EXCEEDED, and the worker stops the request.
  grpc::ClientContext short_deadline;
  short_deadline.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(60));
  const StreamResult cut = Stream(*stub_, Request({1, 2, 3}, 239), &short_deadline);
  EXPECT_EQ(cut.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << cut.status.error_message();
  int busy = 1;
  for (int i = 0; i < 100 && busy != 0; ++i) {
    busy = WorkerRunning(0) + WorkerRunning(1);
    if (busy != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(busy, 0);
}

TEST_F(RouterProcess, CancellationReachesTheWorker) {
  grpc::ClientContext context;
  bool cancelled = false;
  const StreamResult r = Stream(*stub_, Request({3, 4, 5}, 230), &context, [&](int n) {
    if (n == 3 && !cancelled) {
      EXPECT_EQ(WorkerRunning(0) + WorkerRunning(1), 1);
      context.TryCancel();
      cancelled = true;
    }
  });
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  int busy = 1;
  for (int i = 0; i < 100 && busy != 0; ++i) {
    busy = WorkerRunning(0) + WorkerRunning(1);
    if (busy != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(busy, 0) << "the worker ended the cancelled request";
}

TEST_F(RouterProcess, SessionsStickAndDrainingWorkersGetNoNewRequests) {
  // A session's requests land on one worker: watch which one is busy during a long request.
  auto busy_worker = [&](const std::string& session) {
    v1::GenerateRequest r = Request({9, 8, 7}, 230);
    r.set_session_id(session);
    int which = -1;
    Stream(*stub_, r, nullptr, [&](int n) {
      if (n == 2) which = WorkerRunning(0) == 1 ? 0 : (WorkerRunning(1) == 1 ? 1 : -1);
    });
    return which;
  };
  const int a = busy_worker("session-a");
  ASSERT_GE(a, 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(busy_worker("session-a"), a);
  // Drain that worker: its sessions move, and new requests all succeed on the other one.
  workers_[a]->Signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(Stream(*stub_, Request({1, 2, 3 + i}, 4)).status.ok());
  }
  EXPECT_EQ(busy_worker("session-a"), 1 - a);
}

// A conversation through the router: the second turn (first prompt + answer + new tokens,
// same session) takes the first turn's KV over in the store (usage.cached_tokens) and streams
// what a request without a session streams for the same prompt.
TEST_F(RouterProcess, AConversationsSecondTurnReusesItsKv) {
  const std::vector<int32_t> first_prompt = RandomTokens(30, kVocab, 91);
  v1::GenerateRequest first = Request(first_prompt, 12);
  first.set_session_id("conversation-x");
  const StreamResult one = Stream(*stub_, first);
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  EXPECT_EQ(one.last.usage().cached_tokens(), 0);
  std::vector<int32_t> second_prompt = first_prompt;
  second_prompt.insert(second_prompt.end(), one.tokens.begin(), one.tokens.end());
  for (int32_t t : RandomTokens(9, kVocab, 92)) second_prompt.push_back(t);
  v1::GenerateRequest second = Request(second_prompt, 12);
  second.set_session_id("conversation-x");
  const StreamResult two = Stream(*stub_, second);
  ASSERT_TRUE(two.status.ok()) << two.status.error_message();
  EXPECT_EQ(two.last.usage().cached_tokens(),
            static_cast<int64_t>(first_prompt.size() + one.tokens.size() - 1));
  const StreamResult cold = Stream(*stub_, Request(second_prompt, 12));
  ASSERT_TRUE(cold.status.ok()) << cold.status.error_message();
  EXPECT_EQ(cold.last.usage().cached_tokens(), 0);
  EXPECT_EQ(two.tokens, cold.tokens);
}

// sampling.logprobs reaches the client through the router: one entry per token, with the
// asked number of alternatives, the greedy token the most likely; out of range is refused.
TEST_F(RouterProcess, LogprobsComeWithEachToken) {
  v1::GenerateRequest r = Request(RandomTokens(10, kVocab, 93), 8);
  r.mutable_sampling()->set_logprobs(2);
  grpc::ClientContext c;
  auto reader = stub_->Generate(&c, r);
  v1::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) {
    ASSERT_EQ(m.logprobs_size(), m.token_ids_size());
    for (int i = 0; i < m.token_ids_size(); ++i) {
      ASSERT_EQ(m.logprobs(i).top_size(), 2);
      EXPECT_EQ(m.logprobs(i).top(0).token_id(), m.token_ids(i));
      EXPECT_FLOAT_EQ(m.logprobs(i).top(0).logprob(), m.logprobs(i).logprob());
      EXPECT_LE(m.logprobs(i).logprob(), 0.0f);
      ++tokens;
    }
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 8);
  r.mutable_sampling()->set_logprobs(21);
  const StreamResult bad = Stream(*stub_, r);
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.status.error_message().find("sampling.logprobs"), std::string::npos)
      << bad.status.error_message();
}

// sampling.prompt_logprobs reaches the client through the router with the first message: one
// entry per prompt token after the first, naming it, with its rank and the asked alternatives;
// the generated tokens are those of the same request without them. A session's request that
// asks for them computes its whole prompt (no cached tokens, every entry); out of range is
// refused.
TEST_F(RouterProcess, PromptLogprobsComeWithTheFirstMessage) {
  const auto prompt = RandomTokens(10, kVocab, 95);
  const StreamResult plain = Stream(*stub_, Request(prompt, 6));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  for (const std::string session : {"", "conversation-pl"}) {
    SCOPED_TRACE(session.empty() ? "no session" : "a session's second request");
    v1::GenerateRequest r = Request(prompt, 6);
    r.set_session_id(session);
    if (!session.empty()) {
      ASSERT_TRUE(Stream(*stub_, r).status.ok());  // keeps its KV
    }
    r.mutable_sampling()->set_prompt_logprobs(3);
    grpc::ClientContext c;
    auto reader = stub_->Generate(&c, r);
    v1::GenerateResponse m;
    std::vector<int32_t> tokens;
    int messages = 0;
    while (reader->Read(&m)) {
      tokens.insert(tokens.end(), m.token_ids().begin(), m.token_ids().end());
      if (messages++ > 0) {
        EXPECT_EQ(m.prompt_logprobs_size(), 0);
        continue;
      }
      ASSERT_EQ(m.prompt_logprobs_size(), static_cast<int>(prompt.size()) - 1);
      for (int j = 0; j < m.prompt_logprobs_size(); ++j) {
        const v1::Logprobs& lp = m.prompt_logprobs(j);
        EXPECT_EQ(lp.token_id(), prompt[j + 1]) << j;
        EXPECT_LE(lp.logprob(), 0.0f);
        ASSERT_EQ(lp.top_size(), 3);
        EXPECT_GE(lp.rank(), 1);
        EXPECT_LE(lp.logprob(), lp.top(0).logprob());
        for (int t = 0; t < 3; ++t) {
          if (t > 0) {
            EXPECT_GE(lp.top(t - 1).logprob(), lp.top(t).logprob());
          }
          // The prompt token is the t-th alternative exactly when its rank is t + 1.
          EXPECT_EQ(lp.top(t).token_id() == lp.token_id(), lp.rank() == t + 1) << j << " " << t;
        }
      }
    }
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(tokens, plain.tokens);
    EXPECT_EQ(m.usage().cached_tokens(), 0);
    if (!session.empty()) {  // without them, the session's next request takes its KV over
      r.mutable_sampling()->clear_prompt_logprobs();
      const StreamResult next = Stream(*stub_, r);
      ASSERT_TRUE(next.status.ok()) << next.status.error_message();
      EXPECT_EQ(next.last.usage().cached_tokens(), static_cast<int64_t>(prompt.size()) - 1);
    }
  }
  v1::GenerateRequest bad = Request(prompt, 6);
  bad.mutable_sampling()->set_prompt_logprobs(21);
  const StreamResult refused = Stream(*stub_, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("sampling.prompt_logprobs"), std::string::npos)
      << refused.status.error_message();
}

// n > 1 through the router (sampling.n): the samples' messages carry their index, each sample
// ends with a last message of its own whose seed is the request's + index, and its tokens are
// those of a single request with that seed; the prompt was computed once (the other samples'
// usage: the whole prompt cached); n past the limit, or with a session, is refused naming the
// field.
TEST_F(RouterProcess, SamplesOfOneRequestShareThePrefillAndEqualSingleRequests) {
  const auto prompt = RandomTokens(14, kVocab, 96);
  constexpr int kSamples = 3;
  v1::GenerateRequest r = Request(prompt, 8, /*temperature=*/0.9f, /*seed=*/500);
  r.mutable_sampling()->set_n(kSamples);
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = stub_->Generate(&c, r);
  std::vector<std::vector<int32_t>> tokens(kSamples);
  std::vector<v1::GenerateResponse> last(kSamples);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    ASSERT_GE(m.index(), 0);
    ASSERT_LT(m.index(), kSamples);
    EXPECT_EQ(last[m.index()].finish_reason(), v1::FINISH_REASON_UNSPECIFIED)
        << "a message after sample " << m.index() << "'s last";
    tokens[m.index()].insert(tokens[m.index()].end(), m.token_ids().begin(), m.token_ids().end());
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last[m.index()] = m;
  }
  const grpc::Status st = reader->Finish();
  ASSERT_TRUE(st.ok()) << st.error_message();
  for (int i = 0; i < kSamples; ++i) {
    SCOPED_TRACE(absl::StrCat("sample ", i));
    EXPECT_EQ(last[i].finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(last[i].seed(), 500u + i);
    EXPECT_EQ(last[i].usage().prompt_tokens(), 14);
    EXPECT_EQ(last[i].usage().cached_tokens(), i == 0 ? 0 : 14);
    const StreamResult single = Stream(*stub_, Request(prompt, 8, 0.9f, 500 + i));
    ASSERT_TRUE(single.status.ok()) << single.status.error_message();
    EXPECT_EQ(tokens[i], single.tokens);
  }
  v1::GenerateRequest bad = Request(prompt, 4);
  bad.mutable_sampling()->set_n(17);
  StreamResult refused = Stream(*stub_, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("sampling.n"), std::string::npos)
      << refused.status.error_message();
  bad.mutable_sampling()->set_n(2);
  bad.set_session_id("conversation-n");
  refused = Stream(*stub_, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("sampling.n"), std::string::npos)
      << refused.status.error_message();
}

// A worker killed while requests of several samples stream from it: each sample continues on
// the other worker from its own tokens and stored KV (resumed_samples), so every sample's
// tokens are still those of a single request with its seed, none lost or repeated.
TEST_F(RouterProcess, KillingAWorkerMidStreamResumesEverySample) {
  constexpr int kStreams = 4, kSamples = 3, kNew = 150;
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<std::vector<int32_t>>> want(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    const auto prompt = RandomTokens(9 + s, kVocab, 60 + s);
    for (int i = 0; i < kSamples; ++i) {
      want[s].push_back(Direct(1, Request(prompt, kNew, 0.9f, 300 + 10 * s + i)));
    }
    requests.push_back(Request(prompt, kNew, 0.9f, 300 + 10 * s));
    requests.back().mutable_sampling()->set_n(kSamples);
  }
  std::vector<std::vector<std::vector<int32_t>>> got(kStreams,
                                                     std::vector<std::vector<int32_t>>(kSamples));
  std::vector<grpc::Status> status(kStreams);
  std::vector<int> failovers(kStreams, 0);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      grpc::ClientContext c;
      c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      auto reader = stub_->Generate(&c, requests[s]);
      v1::GenerateResponse m;
      int tokens = 0;
      while (reader->Read(&m)) {
        if (m.index() < 0 || m.index() >= kSamples) continue;  // failed below
        auto& to = got[s][m.index()];
        to.insert(to.end(), m.token_ids().begin(), m.token_ids().end());
        failovers[s] = std::max(failovers[s], m.failovers());
        tokens += m.token_ids_size();
        if (tokens >= 3 * kSamples && tokens - m.token_ids_size() < 3 * kSamples) {
          started.fetch_add(1);
        }
      }
      status[s] = reader->Finish();
    });
  }
  for (int i = 0; i < 1000 && started.load() < kStreams; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(started.load(), kStreams) << "streams should still be running when the worker dies";
  workers_[0]->Kill();
  for (auto& t : threads) t.join();
  int moved = 0;
  for (int s = 0; s < kStreams; ++s) {
    ASSERT_TRUE(status[s].ok()) << "request " << s << ": " << status[s].error_message();
    for (int i = 0; i < kSamples; ++i) {
      EXPECT_EQ(got[s][i], want[s][i])
          << "request " << s << " sample " << i << " lost, repeated or changed tokens";
    }
    moved += failovers[s];
  }
  EXPECT_GT(moved, 0) << "some requests ran on the killed worker";
}

// The last message names what ended a STOP: the stop token; min_tokens keeps it from ending
// the stream earlier.
TEST_F(RouterProcess, TheStopReasonNamesTheTokenAndMinTokensHoldsIt) {
  const auto prompt = RandomTokens(12, kVocab, 94);
  const StreamResult free_run = Stream(*stub_, Request(prompt, 6));
  ASSERT_TRUE(free_run.status.ok());
  const int32_t first = free_run.tokens.at(0);
  v1::GenerateRequest r = Request(prompt, 6);
  r.mutable_stopping()->add_stop_token_ids(first);
  const StreamResult stopped = Stream(*stub_, r);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status.error_message();
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>{first});
  EXPECT_EQ(stopped.last.finish_reason(), v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.last.stop().token_id(), first);
  r.mutable_stopping()->set_min_tokens(3);
  const StreamResult held = Stream(*stub_, r);
  ASSERT_TRUE(held.status.ok()) << held.status.error_message();
  ASSERT_GE(held.tokens.size(), 3u);
  EXPECT_NE(held.tokens[0], first);
  r.mutable_stopping()->set_min_tokens(7);  // more than max_new_tokens
  EXPECT_EQ(Stream(*stub_, r).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// Streams 5 tokens once the router has found its worker (health checks take a moment): the
// status of the first success, or of the last of 50 tries 100 ms apart.
grpc::Status StreamOnceReady(v1::Generation::Stub& stub) {
  grpc::Status last;
  for (int i = 0; i < 50; ++i) {
    const StreamResult r = Stream(stub, Request({1, 2, 3}, 5));
    last = r.status;
    if (last.ok()) {
      EXPECT_EQ(r.tokens.size(), 5u);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return last;
}

TEST(TlsProcess, EveryServiceSpeaksTlsAndInternalOnesRequireClientCertificates) {
  const std::string dir = MakeCertificates();
  const std::string ca = dir + "/ca.pem", cert = dir + "/service.pem", key = dir + "/service.key";
  const std::vector<std::string> serve_tls = {"--tls_cert=" + cert, "--tls_key=" + key};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const int store_port = FreePort(), worker_port = FreePort(), router_port = FreePort();
  ServerProcess store("infinigen-kvstore",
                      with({"--listen=" + Addr(store_port), "--capacity_mb=32",
                            "--huge_pages=false", "--tls_client_ca=" + ca},
                           serve_tls),
                      store_port);
  ASSERT_TRUE(store.running());
  ServerProcess worker(
      "infinigen-worker",
      with({"--model=" + testing::FixturePath(kModel), "--listen=" + Addr(worker_port),
            "--policy=full", "--threads=1", "--kv_transport=grpc", "--kv_store=" + Addr(store_port),
            "--kv_store_tls_ca=" + ca, "--tls_client_ca=" + ca},
           serve_tls),
      worker_port);
  ASSERT_TRUE(worker.running());
  ServerProcess router("infinigen-router",
                       with({"--listen=" + Addr(router_port), "--workers=" + Addr(worker_port),
                             "--worker_tls_ca=" + ca, "--health_interval_ms=200"},
                            serve_tls),
                       router_port);
  ASSERT_TRUE(router.running());

  grpc::SslCredentialsOptions client_tls;
  client_tls.pem_root_certs = ReadFile(ca);
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(Addr(router_port), grpc::SslCredentials(client_tls)));
  const grpc::Status first = StreamOnceReady(*stub);
  EXPECT_TRUE(first.ok()) << "TLS client -> TLS router -> mTLS worker -> mTLS store: "
                          << first.error_message();
  // A plaintext client cannot talk to the router.
  grpc::ClientContext c1;
  c1.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::ModelInfo info;
  EXPECT_FALSE(PublicStub(router_port)->GetModelInfo(&c1, v1::GetModelInfoRequest(), &info).ok());
  // A TLS client without a client certificate cannot reach the worker (mTLS).
  auto worker_stub = wv1::Worker::NewStub(
      grpc::CreateChannel(Addr(worker_port), grpc::SslCredentials(client_tls)));
  grpc::ClientContext c2;
  c2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  wv1::InfoResponse winfo;
  EXPECT_FALSE(worker_stub->Info(&c2, wv1::InfoRequest(), &winfo).ok());
}

// Workers found by DNS are dialled by IP, yet their certificates name the DNS name (a pod's IP
// is not known when its certificate is issued): the router checks the name it resolved.
TEST(TlsProcess, WorkersFoundByDnsPresentCertificatesForTheName) {
  if (!LocalhostResolvesToLoopback()) {
    GTEST_SKIP() << "needs a resolver entry for localhost -> 127.0.0.1 (/etc/hosts)";
  }
  const std::string dir = MakeCertificates("tls_dns", "DNS:localhost");
  const std::string ca = dir + "/ca.pem", cert = dir + "/service.pem", key = dir + "/service.key";
  const int worker_port = FreePort(), router_port = FreePort();
  ServerProcess worker(
      "infinigen-worker",
      {"--model=" + testing::FixturePath(kModel), "--listen=" + Addr(worker_port), "--policy=full",
       "--threads=1", "--tls_cert=" + cert, "--tls_key=" + key, "--tls_client_ca=" + ca},
      worker_port);
  ASSERT_TRUE(worker.running());
  ServerProcess router(
      "infinigen-router",
      {"--listen=" + Addr(router_port), "--workers=dns:///localhost:" + std::to_string(worker_port),
       "--worker_tls_ca=" + ca, "--tls_cert=" + cert, "--tls_key=" + key,
       "--health_interval_ms=200"},
      router_port);
  ASSERT_TRUE(router.running());
  // The router serves TLS too (one --tls_cert): the client checks it against "localhost".
  grpc::SslCredentialsOptions client_tls;
  client_tls.pem_root_certs = ReadFile(ca);
  auto stub = v1::Generation::NewStub(grpc::CreateChannel(
      "localhost:" + std::to_string(router_port), grpc::SslCredentials(client_tls)));
  const grpc::Status first = StreamOnceReady(*stub);
  EXPECT_TRUE(first.ok()) << "router -> worker by DNS name over mTLS: " << first.error_message();
}

// Runs `infinigen load` and returns its JSON report.
nlohmann::json Load(int port, int streams, int seconds) {
  const std::string json = ::testing::TempDir() + "/load_" + std::to_string(port) + ".json";
  const std::string cmd = testing::BinaryPath("infinigen") + " load --server " + Addr(port) +
                          " --streams " + std::to_string(streams) + " --seconds " +
                          std::to_string(seconds) + " --max-tokens 24 --temperature 0.7 --json " +
                          json + " > " + json + ".log 2>&1";
  std::remove(json.c_str());
  int rc = std::system(cmd.c_str());
  // A sanitizer's own failure (its runtime dying on a check or a mapping it did not expect,
  // exit 66 before the client wrote anything) says nothing of the code: once more. A report
  // (a race, a leak) fails the test with the client's log, which holds it.
  const auto tool_failed = [&] {
    const std::string log = ReadFile(json + ".log");
    return log.find("FATAL: ThreadSanitizer") != std::string::npos ||
           log.find("Sanitizer: CHECK failed") != std::string::npos;
  };
  if (rc != 0 && tool_failed()) {
    std::cerr << "the sanitizer's runtime failed in `infinigen load`; once more:\n"
              << ReadFile(json + ".log");
    std::remove(json.c_str());
    rc = std::system(cmd.c_str());
  }
  EXPECT_EQ(rc, 0) << cmd << "\n" << (rc != 0 ? ReadFile(json + ".log") : "");
  std::ifstream in(json);
  return nlohmann::json::parse(in, nullptr, false);
}

TEST_F(RouterProcess, BoundedLoadThroughTheRouterHasNoErrors) {
  const nlohmann::json j = Load(router_port_, 16, 20);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["errors"].get<int>(), 0) << j.dump();
  EXPECT_GT(j["requests_ok"].get<int>(), 16) << j.dump();
}

// The flags a program's --help lists ("  --name"), without their dashes.
std::set<std::string> HelpFlags(const std::string& command) {
  FILE* p = popen((command + " --help 2>&1").c_str(), "r");
  EXPECT_NE(p, nullptr) << command;
  if (p == nullptr) return {};
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
  pclose(p);
  std::set<std::string> flags;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, "  --")) continue;
    flags.emplace(line.substr(0, line.find_first_of(" ")));
  }
  return flags;
}

// One flag system: each service binary's --help lists its own flags, and `infinigen serve`
// (router + worker in one process) takes every serving flag of both under the same name, but
// for what only a split deployment has (workers to reach, the store's address and transport)
// and the worker's queue (--max-queued-worker: --max-queued is the router's).
TEST(Binaries, HelpListsTheirFlagsAndServeTakesTheirServingFlags) {
  const std::set<std::string> router = HelpFlags(testing::BinaryPath("infinigen-router"));
  const std::set<std::string> worker = HelpFlags(testing::BinaryPath("infinigen-worker"));
  const std::set<std::string> kvstore = HelpFlags(testing::BinaryPath("infinigen-kvstore"));
  const std::set<std::string> serve = HelpFlags(testing::BinaryPath("infinigen") + " serve");
  EXPECT_TRUE(router.count("api-keys-file") && router.count("listen")) << router.size();
  EXPECT_TRUE(worker.count("kv-transport") && worker.count("listen")) << worker.size();
  EXPECT_TRUE(kvstore.count("capacity-mb") && kvstore.count("listen")) << kvstore.size();
  EXPECT_GT(serve.size(), 40u);
  const std::set<std::string> router_only = {"workers", "worker-tls-ca", "health-interval-ms",
                                             "health-misses"};
  const std::set<std::string> worker_only = {
      "kv-transport",     "kv-store",          "kv-store-tls-ca",          "kv-append-linger-ms",
      "kv-device-gather", "hold-loading-ms",   "kv-resident-dense-layers", "kv-row-reuse",
      "kv-device-plan",   "kv-call-timeout-ms"};
  for (const std::string& f : router) {
    if (!router_only.count(f)) EXPECT_TRUE(serve.count(f)) << "serve lacks the router's --" << f;
  }
  for (const std::string& f : worker) {
    if (!worker_only.count(f)) EXPECT_TRUE(serve.count(f)) << "serve lacks the worker's --" << f;
  }
  EXPECT_TRUE(serve.count("max-queued-worker"));
}

TEST(ServeProcess, AllInOneServesThePublicApiAndABoundedLoad) {
  const int port = FreePort();
  ServerProcess serve(
      "infinigen",
      {"serve", "--model=" + testing::FixturePath(kModel), "--listen=" + Addr(port), "--threads=1"},
      port);
  ASSERT_TRUE(serve.running());
  auto stub = PublicStub(port);
  const StreamResult r = Stream(*stub, Request({1, 2, 3, 4}, 12));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 12u);
  // The embedded default: q8 weights, bf16 K/V; the fixture has no sidecar, so `auto` is dense.
  EXPECT_EQ(r.last.usage().backend(), "cpu-q8 (bf16 K/V)");
  EXPECT_EQ(r.last.usage().policy(), "full");
  {
    grpc::ClientContext c;
    v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&c, v1::GetModelInfoRequest(), &info).ok());
    EXPECT_EQ(info.backend(), "cpu-q8 (bf16 K/V)");
  }
  {  // health by the public service's name
    auto health = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(Addr(port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext c;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("infinigen.v1.Generation");
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&c, request, &response).ok());
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  const nlohmann::json j = Load(port, 16, 20);
  ASSERT_FALSE(j.is_discarded());
  EXPECT_EQ(j["errors"].get<int>(), 0) << j.dump();
  EXPECT_GT(j["requests_ok"].get<int>(), 16);
  EXPECT_EQ(serve.Terminate(15), 0) << "SIGTERM drains and exits 0";
}

}  // namespace
}  // namespace infinigen
