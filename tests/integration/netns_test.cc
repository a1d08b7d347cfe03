// The services on separate addresses with real links between them: the KV store, two workers and
// the router each in its own network namespace on a bridge (tests/support/netns.h), the workers
// reaching the store over UCX on their veth link (not loopback; gRPC where the build has no UCX)
// with f32 weights, or through its shared memory (its control calls over the link) with q8.
// kill -9 or SIGSTOP of a worker mid-stream: every stream completes with exactly the tokens of
// its uninterrupted run, continued from its stored KV. The store's link cut mid-stream for 4 s and
// restored: every stream ends (none hangs), with exactly its tokens or with UNAVAILABLE / ABORTED
// after a prefix of them (never a wrong token), and new requests succeed again within 5 s of the
// link coming back. Skipped with a message where namespaces cannot be made (not root, no iproute2).
#include "tests/support/netns.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <csignal>
#include <functional>
#include <thread>

#include "absl/time/clock.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "tests/support/fixture_model.h"
#include "tests/support/process.h"
#include "tests/support/router_streams.h"
#include "tests/support/test_paths.h"
#include "tests/support/token_request.h"

namespace infinigen {
namespace {

using testing::NetnsLab;
using testing::Placement;
using testing::RandomTokens;
using testing::ServerProcess;

constexpr int kVocab = 211;
constexpr int kStorePort = 7000, kUcxPort = 7001, kWorkerPort = 7100, kRouterPort = 7200;
enum Namespace { kStore = 0, kWorkerA = 1, kWorkerB = 2, kRouter = 3 };

using StreamResult = testing::PublicStreamResult;

// How the workers reach the store and store their weights.
struct Variant {
  std::string transport;  // "remote": UCX where the build has it, else gRPC; or "shm"
  std::string weights;    // --cpu_weights
};

class Netns : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    auto lab = NetnsLab::Create(4);
    if (!lab.ok()) GTEST_SKIP() << "cannot make network namespaces: " << lab.status();
    lab_ = std::move(*lab);
#if INFINIGEN_TEST_HAVE_UCX
    const std::string remote = "ucx";
#else
    const std::string remote = "grpc";
#endif
    // shm: the rows through the store's shared memory (one host, namespaces share /dev/shm),
    // the control calls over the store's link.
    const std::string transport = GetParam().transport == "shm" ? "shm" : remote;
    // UCX over the namespace's own link, TCP (veth has no RDMA).
    const std::vector<std::pair<std::string, std::string>> ucx_env = {
        {"UCX_NET_DEVICES", NetnsLab::kDevice}, {"UCX_TLS", "tcp"}};
    std::vector<std::string> store_args = {"--listen=" + At(kStore, kStorePort), "--capacity_mb=64",
                                           "--huge_pages=false"};
    if (transport == "ucx") store_args.push_back("--ucx_port=" + std::to_string(kUcxPort));
    store_ = std::make_unique<ServerProcess>("infinigen-kvstore", store_args, kStorePort,
                                             Where(kStore, ucx_env));
    ASSERT_TRUE(store_->running()) << store_->log_path();
    for (int w = 0; w < 2; ++w) {
      const Namespace ns = w == 0 ? kWorkerA : kWorkerB;
      workers_[w] = std::make_unique<ServerProcess>(
          "infinigen-worker",
          std::vector<std::string>{
              "--model=" + testing::FixturePath("hf/llama31_gqa"),
              "--listen=" + At(ns, kWorkerPort), "--policy=full", "--threads=1", "--max_running=16",
              "--drain_seconds=5", "--cpu_weights=" + GetParam().weights,
              "--kv_transport=" + transport, "--kv_store=" + At(kStore, kStorePort)},
          kWorkerPort, Where(ns, ucx_env));
      ASSERT_TRUE(workers_[w]->running()) << workers_[w]->log_path();
    }
    router_ = std::make_unique<ServerProcess>(
        "infinigen-router",
        std::vector<std::string>{
            "--listen=" + At(kRouter, kRouterPort),
            "--workers=" + At(kWorkerA, kWorkerPort) + "," + At(kWorkerB, kWorkerPort),
            "--health_interval_ms=200", "--max_new_tokens_limit=240"},
        kRouterPort, Where(kRouter, {}));
    ASSERT_TRUE(router_->running()) << router_->log_path();
    stub_ = v1::Generation::NewStub(
        grpc::CreateChannel(At(kRouter, kRouterPort), grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 100 && AvailableWorkers() != 2; ++i)
      absl::SleepFor(absl::Milliseconds(100));
    ASSERT_EQ(AvailableWorkers(), 2);
  }

  std::string At(Namespace ns, int port) const {
    return lab_->host(ns) + ":" + std::to_string(port);
  }
  Placement Where(Namespace ns, std::vector<std::pair<std::string, std::string>> env) const {
    Placement p;
    p.netns = lab_->ns(ns);
    p.host = lab_->host(ns);
    p.env = std::move(env);
    return p;
  }

  int AvailableWorkers() {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ModelInfo info;
    return stub_->GetModelInfo(&c, v1::GetModelInfoRequest(), &info).ok() ? info.workers() : -1;
  }

  StreamResult Stream(const v1::GenerateRequest& request) {
    return testing::StreamOne(*stub_, request);
  }

  // Streams `requests` at once; `fault` runs once every stream has its first tokens.
  std::vector<StreamResult> StreamAll(const std::vector<v1::GenerateRequest>& requests,
                                      const std::function<void()>& fault) {
    return testing::StreamAll(*stub_, requests, fault);
  }

  // Requests with their uninterrupted runs' tokens (streamed one at a time, before any fault).
  void Prepare(int n, int max_new, std::vector<v1::GenerateRequest>& requests,
               std::vector<std::vector<int32_t>>& want) {
    for (int i = 0; i < n; ++i) {
      v1::GenerateRequest r;
      testing::FillTokenRequest(r, RandomTokens(10 + 3 * i, kVocab, 500 + i), max_new,
                                i % 2 ? 0.9f : 0.0f, 700 + i);
      requests.push_back(r);
      const StreamResult alone = Stream(r);
      ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
      want.push_back(alone.tokens);
    }
  }

  // 8 streams; `fault` hits worker A once they run: every stream completes with exactly the
  // tokens of its uninterrupted run, and every stream that moved continued from its stored KV.
  void ExpectEveryStreamExactAndResumed(const std::function<void()>& fault) {
    std::vector<v1::GenerateRequest> requests;
    std::vector<std::vector<int32_t>> want;
    Prepare(8, 220, requests, want);
    const std::vector<StreamResult> got = StreamAll(requests, fault);
    int moved = 0, resumed = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].status.ok()) << "stream " << i << ": " << got[i].status.error_message();
      EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i << " lost, repeated or changed tokens";
      moved += got[i].last.failovers();
      resumed += got[i].last.resumes();
    }
    EXPECT_GT(moved, 0) << "some streams ran on the worker that failed";
    EXPECT_EQ(resumed, moved) << "every moved stream continued from its stored KV";
  }

  std::unique_ptr<NetnsLab> lab_;
  std::unique_ptr<ServerProcess> store_, router_, workers_[2];
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_P(Netns, AKilledWorkersStreamsResumeFromTheStoreOnTheOther) {
  ExpectEveryStreamExactAndResumed([&] { workers_[0]->Kill(); });
}

// SIGSTOP of a worker mid-stream (frozen, not dead: its links stay up, its TCP connections open):
// the router finds its streams silent and moves them; the other worker takes their KV over from
// the store across the links, and every stream completes with exactly its tokens.
TEST_P(Netns, AFrozenWorkersStreamsResumeFromTheStoreOnTheOther) {
  ExpectEveryStreamExactAndResumed([&] { workers_[0]->Signal(SIGSTOP); });
  workers_[0]->Signal(SIGCONT);
}

// The link is down for 4 s, twice the workers' KV call timeout: calls to the store fail while
// it is down, and reconnect once it is back.
TEST_P(Netns, TheStoresLinkCutMidStreamAndRestored) {
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<int32_t>> want;
  Prepare(8, 220, requests, want);
  v1::GenerateRequest probe;
  testing::FillTokenRequest(probe, {5, 6, 7}, 4, 0, 1);
  absl::Duration back = absl::InfiniteDuration();
  const absl::Time start = absl::Now();
  const std::vector<StreamResult> got = StreamAll(requests, [&] {
    ASSERT_TRUE(lab_->Cut(kStore).ok());
    absl::SleepFor(absl::Seconds(4));
    ASSERT_TRUE(lab_->Restore(kStore).ok());
    const absl::Time restored = absl::Now();
    // New requests, while the streams of before the cut still run.
    for (int i = 0; i < 100; ++i) {
      if (Stream(probe).status.ok()) {
        back = absl::Now() - restored;
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(60)) << "streams hung on the cut link";
  int completed = 0, failovers = 0, resumes = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    failovers += got[i].last.failovers();
    resumes += got[i].last.resumes();
    const grpc::StatusCode code = got[i].status.error_code();
    EXPECT_TRUE(code == grpc::StatusCode::OK || code == grpc::StatusCode::UNAVAILABLE ||
                code == grpc::StatusCode::ABORTED)
        << "stream " << i << ": " << code << " " << got[i].status.error_message();
    EXPECT_FALSE(got[i].status.error_message().empty() && code != grpc::StatusCode::OK);
    ASSERT_LE(got[i].tokens.size(), want[i].size()) << "stream " << i;
    EXPECT_TRUE(std::equal(got[i].tokens.begin(), got[i].tokens.end(), want[i].begin()))
        << "stream " << i << " sent a token its uninterrupted run does not have";
    if (code == grpc::StatusCode::OK) {
      EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i;
      ++completed;
    }
  }
  std::printf(
      "store link cut for 4 s: %d of %zu streams completed (%d failovers, %d resumed), the "
      "others failed cleanly; a new request succeeded %.2f s after the link came back\n",
      completed, got.size(), failovers, resumes, absl::ToDoubleSeconds(back));
  EXPECT_LT(back, absl::Seconds(5)) << "new requests kept failing after the link came back";
  const StreamResult after = Stream(requests[0]);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, want[0]);
}

INSTANTIATE_TEST_SUITE_P(Transports, Netns,
                         ::testing::Values(Variant{"remote", "f32"}, Variant{"shm", "q8"}),
                         [](const ::testing::TestParamInfo<Variant>& info) {
                           return info.param.transport + "_" + info.param.weights;
                         });

}  // namespace
}  // namespace infinigen
