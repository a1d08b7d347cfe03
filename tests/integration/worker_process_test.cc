// infinigen-worker and infinigen-kvstore as real processes on 127.0.0.1, with the tiny Llama 3.1
// fixture: the `full` policy streams exactly the tokens of the local engine; `infinigen` runs
// and fetches less than a full fetch; 16 concurrent streams with different prompts and sampling
// each produce what they produce alone; a cancelled stream frees its store sequence; a store
// killed mid-stream ends the stream with UNAVAILABLE while the worker stays healthy and serves
// again once the store is back; a store frozen for less than --kv_call_timeout_ms is waited for,
// one frozen longer fails the stream; malformed requests get INVALID_ARGUMENT; SIGTERM drains;
// while the model loads, health is NOT_SERVING and calls are UNAVAILABLE.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "gpu_worker/engine/generator.h"
#include "gpu_worker/infinigen/prepare.h"
#include "gpu_worker/infinigen/sidecar.h"
#include "gpu_worker/kv/backend_kv_cache.h"
#include "gpu_worker/kv/kv_pool_cache.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "kv_store/client/kv_store_client.h"
#include "tests/support/fixture_model.h"
#include "tests/support/health_check.h"
#include "tests/support/http_get.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"
#include "tests/support/worker_stream.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;
using testing::FreePort;
using testing::ServerProcess;

const char* kModel = "hf/llama31_gqa";

using testing::RandomTokens;

using StreamResult = testing::WorkerStreamResult;
using testing::StreamWorker;

using testing::TokenRequest;

class WorkerProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = new testing::LoadedModel(testing::LoadModel(testing::FixturePath(kModel)));
    // An InfiniGen sidecar for the fixture.
    auto tokens = RandomTokens(96, (*model_).model->config().vocab_size, 5);
    PrepareOptions po;
    po.ratio = 0.5f;
    po.chunk_tokens = 40;
    auto s = PrepareInfinigen(*model_->model, *model_->ckpt, tokens, po);
    ASSERT_TRUE(s.ok()) << s.status();
    // One file per test process: ctest runs this suite's tests in parallel processes, and each
    // removes its own at the end.
    sidecar_path_ = new std::string(::testing::TempDir() + "/worker_test_" +
                                    std::to_string(::getpid()) + ".infinigen.safetensors");
    ASSERT_TRUE(WriteSidecar(*s, *sidecar_path_).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*sidecar_path_);
    delete model_;
    delete sidecar_path_;
  }

  void SetUp() override {
    store_port_ = FreePort();
    store_metrics_port_ = FreePort();
    StartStore();
    worker_port_ = FreePort();
    worker_metrics_port_ = FreePort();
    worker_ = StartWorker(worker_port_, {"--metrics_port=" + std::to_string(worker_metrics_port_)});
    ASSERT_TRUE(worker_->running());
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(worker_port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = wv1::Worker::NewStub(channel_);
  }
  // A worker of the fixture's model over the store, with `extra` flags.
  std::unique_ptr<ServerProcess> StartWorker(int port, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--model=" + testing::FixturePath(kModel),
                                     "--sidecar=" + *sidecar_path_,
                                     "--listen=127.0.0.1:" + std::to_string(port),
                                     "--kv_transport=grpc",
                                     "--kv_store=127.0.0.1:" + std::to_string(store_port_),
                                     "--policy=full",
                                     "--dense_layers=1",
                                     "--budget=0.3",
                                     "--min_budget_tokens=8",
                                     "--threads=1",
                                     "--max_running=16"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<ServerProcess>("infinigen-worker", args, port);
  }
  void StartStore() {
    store_ = std::make_unique<ServerProcess>(
        "infinigen-kvstore",
        std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(store_port_),
                                 "--capacity_mb=64", "--huge_pages=false",
                                 "--metrics_port=" + std::to_string(store_metrics_port_)},
        store_port_);
    ASSERT_TRUE(store_->running());
  }
  int64_t StoreSequences() {
    KvClientConfig c;
    c.transport = KvClientConfig::Transport::kGrpc;
    c.address = "127.0.0.1:" + std::to_string(store_port_);
    c.renew_every = absl::ZeroDuration();
    auto client = MakeKvStoreClient(c);
    if (!client.ok()) return -1;
    auto stats = (*client)->Stats();
    return stats.ok() ? stats->sequences : -1;
  }
  // What the local engine generates for the same request.
  std::vector<int32_t> Local(const std::vector<int32_t>& prompt, int max_new, float temperature,
                             uint64_t seed) {
    BackendKvCache cache(*model_->backend, model_->model->kv_shape());
    GenerateOptions o;
    o.max_new_tokens = max_new;
    o.ignore_eos = true;
    o.sampling.temperature = temperature;
    o.sampling.top_k = temperature > 0 ? 30 : 0;
    o.sampling.seed = seed;
    auto r = Generate(*model_->model, cache, 1, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->tokens : std::vector<int32_t>{};
  }
  int64_t vocab() const { return model_->model->config().vocab_size; }

  static testing::LoadedModel* model_;
  static std::string* sidecar_path_;
  int store_port_ = 0, worker_port_ = 0, store_metrics_port_ = 0, worker_metrics_port_ = 0;
  std::unique_ptr<ServerProcess> store_, worker_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<wv1::Worker::Stub> stub_;
};
testing::LoadedModel* WorkerProcess::model_ = nullptr;
std::string* WorkerProcess::sidecar_path_ = nullptr;

TEST_F(WorkerProcess, FullPolicyStreamsExactlyTheLocalEnginesTokens) {
  const auto prompt = RandomTokens(37, vocab(), 1);
  const StreamResult r = StreamWorker(*stub_, TokenRequest(prompt, 40, 0.0f, 0));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, Local(prompt, 40, 0.0f, 0));
  EXPECT_EQ(r.last.finish_reason(), infinigen::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.last.usage().prompt_tokens(), 37);
  EXPECT_EQ(r.last.usage().generated_tokens(), 40);
  EXPECT_DOUBLE_EQ(r.last.usage().selection_fraction(), 1.0);
  EXPECT_GT(r.last.usage().kv_bytes_fetched(), 0);
  EXPECT_GT(r.last.timings().time_to_first_token_seconds(), 0.0);
  EXPECT_EQ(r.last.usage().policy(), "full");
  EXPECT_EQ(r.last.usage().backend(), "cpu-f32");
}

TEST_F(WorkerProcess, WorkerAndStoreMetricsCountWhatWasServed) {
  const auto prompt = RandomTokens(21, vocab(), 4);
  const StreamResult r = StreamWorker(*stub_, TokenRequest(prompt, 12, 0.0f, 0));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  // The last message can reach the client before the worker has counted the request (its
  // engine finishes the bookkeeping after sending): scrape until it has, for up to 10 s.
  testing::HttpReply worker;
  for (int i = 0; i < 200; ++i) {
    worker = testing::HttpGet(worker_metrics_port_, "/metrics");
    if (worker.code == 200 &&
        testing::MetricValue(worker.body, "infinigen_worker_requests_finished_total") >= 1 &&
        testing::MetricValue(worker.body, "infinigen_worker_running_requests") == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(worker.code, 200);
  auto value = [&](const char* metric) { return testing::MetricValue(worker.body, metric); };
  EXPECT_EQ(value("infinigen_worker_generated_tokens_total"), 12);
  EXPECT_EQ(value("infinigen_worker_prompt_tokens_total"), 21);
  EXPECT_EQ(value("infinigen_worker_requests_finished_total"), 1);
  EXPECT_EQ(value("infinigen_worker_requests_failed_total"), 0);
  EXPECT_EQ(value("infinigen_worker_running_requests"), 0);
  EXPECT_GE(value("infinigen_worker_steps_total"), 12);
  EXPECT_EQ(value("infinigen_worker_kv_bytes_fetched_total"), r.last.usage().kv_bytes_fetched());
  EXPECT_EQ(value("infinigen_worker_time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(value("infinigen_worker_time_per_output_token_seconds_count"), 1);  // per request

  const testing::HttpReply store = testing::HttpGet(store_metrics_port_, "/metrics");
  ASSERT_EQ(store.code, 200);
  EXPECT_GT(testing::MetricValue(store.body, "infinigen_kvstore_appends_total"), 0);
  EXPECT_GT(testing::MetricValue(store.body, "infinigen_kvstore_gathered_bytes_total"), 0);
  EXPECT_EQ(testing::MetricValue(store.body, "infinigen_kvstore_sequences"), 0)
      << "the finished request's sequence is closed";
}

// A worker whose sequences keep a share of 40 tokens in the store (FIFO eviction, over gRPC:
// the slots travel with the appends) streams what the local engine over its own resident KV
// pool of 40 tokens streams, and counts the evictions.
TEST_F(WorkerProcess, AKvPoolKeepsEachSequenceWithinItsShare) {
  const int port = FreePort(), metrics_port = FreePort();
  ServerProcess pooled("infinigen-worker",
                       {"--model=" + testing::FixturePath(kModel), "--sidecar=" + *sidecar_path_,
                        "--listen=127.0.0.1:" + std::to_string(port), "--kv_transport=grpc",
                        "--kv_store=127.0.0.1:" + std::to_string(store_port_), "--policy=full",
                        "--threads=1", "--kv_pool_tokens=40", "--kv_pool_eviction=fifo",
                        "--metrics_port=" + std::to_string(metrics_port)},
                       port);
  ASSERT_TRUE(pooled.running());
  auto stub = wv1::Worker::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  const auto prompt = RandomTokens(30, vocab(), 6);
  const StreamResult r = StreamWorker(*stub, TokenRequest(prompt, 40, 0.0f, 0));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  KvPoolConfig config;
  config.capacity_tokens = 40;
  config.eviction = EvictionPolicy::kFifo;
  KvPoolCache pool(*model_->backend, model_->model->kv_shape(), config);
  GenerateOptions o;
  o.max_new_tokens = 40;
  o.ignore_eos = true;
  o.sampling.temperature = 0.0f;
  auto local = Generate(*model_->model, pool, 1, prompt, o);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(r.tokens, local->tokens);
  EXPECT_GT(pool.evictions(), 0);

  testing::HttpReply metrics;
  for (int i = 0; i < 200; ++i) {  // counted just after the last message is sent
    metrics = testing::HttpGet(metrics_port, "/metrics");
    if (testing::MetricValue(metrics.body, "infinigen_worker_requests_finished_total") >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(testing::MetricValue(metrics.body, "infinigen_worker_kv_pool_evictions_total"),
            pool.evictions());
}

TEST_F(WorkerProcess, InfinigenRunsAndFetchesLess) {
  const auto prompt = RandomTokens(120, vocab(), 2);
  const StreamResult r = StreamWorker(*stub_, TokenRequest(prompt, 30, 0.0f, 0, "infinigen"));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 30u);
  const auto& u = r.last.usage();
  EXPECT_LT(u.kv_bytes_fetched(), u.kv_bytes_full_fetch());
  // Layer 0 dense, layer 1 at a 30% budget: well under 0.75 of a full fetch.
  EXPECT_LT(u.selection_fraction(), 0.75);
  EXPECT_GT(u.selection_fraction(), 0.3);
  EXPECT_EQ(u.policy(), "infinigen");
}

TEST_F(WorkerProcess, InfinigenAttendsDenselyBelowTheMinimumBudget) {
  // --min_budget_tokens=8: a 4-token prompt with 4 new tokens never has more than 8 rows, so
  // every layer reads them all and the tokens are the dense ones.
  const auto prompt = RandomTokens(4, vocab(), 9);
  const StreamResult r = StreamWorker(*stub_, TokenRequest(prompt, 4, 0.0f, 0, "infinigen"));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, Local(prompt, 4, 0.0f, 0));
  EXPECT_DOUBLE_EQ(r.last.usage().selection_fraction(), 1.0);
}

TEST_F(WorkerProcess, SixteenConcurrentStreamsEachProduceWhatTheyProduceAlone) {
  constexpr int kStreams = 16;
  std::vector<std::vector<int32_t>> prompts, want;
  for (int i = 0; i < kStreams; ++i) {
    prompts.push_back(RandomTokens(10 + 6 * i, vocab(), 100 + i));
    want.push_back(Local(prompts[i], 24, i % 2 ? 0.9f : 0.0f, 7 + i));
  }
  std::vector<StreamResult> got(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      got[i] = StreamWorker(*stub_, TokenRequest(prompts[i], 24, i % 2 ? 0.9f : 0.0f, 7 + i));
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i]) << "stream " << i;
  }
  EXPECT_EQ(StoreSequences(), 0);
}

TEST_F(WorkerProcess, CancelMidStreamFreesTheStoreSequence) {
  grpc::ClientContext context;
  bool cancelled = false;
  const auto prompt = RandomTokens(20, vocab(), 3);
  const StreamResult r =
      StreamWorker(*stub_, TokenRequest(prompt, 200, 0.0f, 0), &context, [&](int n) {
        if (n == 3 && !cancelled) {
          EXPECT_EQ(StoreSequences(), 1) << "the stream's sequence is open in the store";
          context.TryCancel();
          cancelled = true;
        }
      });
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  int64_t open = -1;
  for (int i = 0; i < 100 && open != 0; ++i) {
    open = StoreSequences();
    if (open != 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(open, 0) << "cancelling frees the store's sequence";
}

TEST_F(WorkerProcess, KilledStoreEndsTheStreamUnavailableAndTheWorkerRecovers) {
  const auto prompt = RandomTokens(20, vocab(), 4);
  absl::Time killed;
  const StreamResult r =
      StreamWorker(*stub_, TokenRequest(prompt, 200, 0.0f, 0), nullptr, [&](int n) {
        if (n == 1) {
          store_->Signal(SIGSTOP);  // freeze it mid-stream, then kill it
          store_->Kill();
          killed = absl::Now();
        }
      });
  // Reported, not asserted (a timing): docs/benchmarks.md quotes it.
  std::cout << "store killed -> stream error: " << absl::ToDoubleMilliseconds(absl::Now() - killed)
            << " ms" << std::endl;
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE) << r.status.error_message();
  EXPECT_LT(r.tokens.size(), 200u);
  // The worker is alive and healthy.
  grpc::ClientContext hc;
  auto info = std::make_unique<wv1::InfoResponse>();
  EXPECT_TRUE(stub_->Info(&hc, wv1::InfoRequest(), info.get()).ok());
  // The store comes back on the same port: the next request succeeds (after reconnecting).
  StartStore();
  const absl::Time restarted = absl::Now();
  grpc::Status last;
  for (int i = 0; i < 50; ++i) {
    const StreamResult again = StreamWorker(*stub_, TokenRequest(prompt, 10, 0.0f, 0));
    last = again.status;
    if (last.ok()) {
      EXPECT_EQ(again.tokens, Local(prompt, 10, 0.0f, 0));
      std::cout << "store serving again -> a request succeeded: "
                << absl::ToDoubleMilliseconds(absl::Now() - restarted) << " ms" << std::endl;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_TRUE(last.ok()) << last.error_message();
}

// --kv_call_timeout_ms is how long a store may keep a call waiting: frozen for 3 s as a request
// arrives, the store fails the stream of a worker with the default 2 s, while a worker given
// 5 s waits it out and streams exactly the local engine's tokens. Out of range, the flag is
// refused at start.
TEST_F(WorkerProcess, TheKvCallTimeoutIsHowLongAFrozenStoreIsWaitedFor) {
  const int patient_port = FreePort();
  std::unique_ptr<ServerProcess> patient = StartWorker(patient_port, {"--kv_call_timeout_ms=5000"});
  ASSERT_TRUE(patient->running());
  auto patient_stub = wv1::Worker::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(patient_port), grpc::InsecureChannelCredentials()));
  const auto prompt = RandomTokens(20, vocab(), 6);
  // (Waiting for the channel: the first connection to a fresh worker on a loaded 2-core machine
  // once failed before the server's first frame came.)
  grpc::ClientContext ready;
  ready.set_wait_for_ready(true);
  ready.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const StreamResult first = StreamWorker(*patient_stub, TokenRequest(prompt, 4, 0.0f, 0), &ready);
  ASSERT_TRUE(first.status.ok()) << first.status.error_code() << " "
                                 << first.status.error_message();
  // The store frozen for 3 s while `stub`'s worker streams a request.
  auto frozen = [&](wv1::Worker::Stub& stub) {
    store_->Signal(SIGSTOP);
    std::thread thaw([&] {
      std::this_thread::sleep_for(std::chrono::seconds(3));
      store_->Signal(SIGCONT);
    });
    const StreamResult r = StreamWorker(stub, TokenRequest(prompt, 40, 0.0f, 0));
    thaw.join();
    return r;
  };
  const StreamResult waited = frozen(*patient_stub);
  EXPECT_TRUE(waited.status.ok()) << waited.status.error_message();
  EXPECT_EQ(waited.tokens, Local(prompt, 40, 0.0f, 0));
  const StreamResult failed = frozen(*stub_);
  EXPECT_FALSE(failed.status.ok()) << failed.tokens.size() << " tokens";
  EXPECT_TRUE(failed.tokens.empty()) << failed.tokens.size() << " tokens";

  for (const char* bad : {"--kv_call_timeout_ms=50", "--kv-call-timeout-ms=700000"}) {
    const std::string cmd = testing::BinaryPath("infinigen-worker") +
                            " --model=/no/such/model --check_flags " + bad + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[1024];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
    const int status = pclose(p);
    EXPECT_EQ(WEXITSTATUS(status), 2) << bad << ": " << out;
    EXPECT_NE(out.find("kv_call_timeout_ms must be in [100, 600000]"), std::string::npos) << out;
  }
}

TEST_F(WorkerProcess, AFullWorkerRefusesWithResourceExhaustedAndARetryHint) {
  // Over the fixture's store, which is stopped while the second request comes: the first
  // cannot finish meanwhile, however fast the worker (no race with its 230 tokens).
  const int port = FreePort();
  ServerProcess small(
      "infinigen-worker",
      {"--model=" + testing::FixturePath(kModel), "--listen=127.0.0.1:" + std::to_string(port),
       "--kv_transport=grpc", "--kv_store=127.0.0.1:" + std::to_string(store_port_),
       "--policy=full", "--threads=1", "--max_running=1", "--max_queued=0"},
      port);
  ASSERT_TRUE(small.running());
  auto stub = wv1::Worker::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  grpc::Status refused;
  std::string pushback;
  const auto prompt = RandomTokens(16, vocab(), 8);
  const StreamResult first =
      StreamWorker(*stub, TokenRequest(prompt, 230, 0.0f, 0), nullptr, [&](int n) {
        if (n != 1) return;
        store_->Signal(SIGSTOP);
        grpc::ClientContext ctx;
        auto reader = stub->Generate(&ctx, TokenRequest(prompt, 4, 0.0f, 0));
        wv1::GenerateResponse msg;
        while (reader->Read(&msg)) {
        }
        refused = reader->Finish();
        auto it = ctx.GetServerTrailingMetadata().find("grpc-retry-pushback-ms");
        if (it != ctx.GetServerTrailingMetadata().end()) {
          pushback = std::string(it->second.data(), it->second.size());
        }
        store_->Signal(SIGCONT);
      });
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_EQ(pushback, "200");
  // Once the first is done, the worker takes the next one.
  EXPECT_TRUE(StreamWorker(*stub, TokenRequest(prompt, 4, 0.0f, 0)).status.ok());
}

TEST_F(WorkerProcess, MalformedRequestsAreInvalidArgument) {
  auto code_of = [&](const wv1::GenerateRequest& r) { return StreamWorker(*stub_, r).status; };
  wv1::GenerateRequest none;  // no input
  EXPECT_EQ(code_of(none).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_id = TokenRequest({1, 2, static_cast<int32_t>(vocab()) + 5}, 4, 0, 0);
  grpc::Status st = code_of(bad_id);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("vocabulary"), std::string::npos) << st.error_message();
  auto too_many = TokenRequest({1, 2}, 100000, 0, 0);
  st = code_of(too_many);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("max_new_tokens"), std::string::npos) << st.error_message();
  auto bad_policy = TokenRequest({1, 2}, 4, 0, 0, "h2o");
  EXPECT_EQ(code_of(bad_policy).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_budget = TokenRequest({1, 2}, 4, 0, 0, "infinigen");
  bad_budget.mutable_selection()->set_budget_fraction(7.0);
  EXPECT_EQ(code_of(bad_budget).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  auto bad_sampling = TokenRequest({1, 2}, 4, 0, 0);
  bad_sampling.mutable_sampling()->set_top_p(-1);
  EXPECT_EQ(code_of(bad_sampling).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Samples: n out of range; a sample resumed twice or past n; resumed samples of one stream.
  auto expect_refused = [&](const wv1::GenerateRequest& r, const std::string& field) {
    const grpc::Status refused = code_of(r);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(refused.error_message().find(field), std::string::npos) << refused.error_message();
  };
  auto samples = TokenRequest({1, 2}, 4, 0.8f, 5);
  samples.mutable_sampling()->set_n(17);
  expect_refused(samples, "sampling.n");
  samples.mutable_sampling()->set_n(2);
  samples.add_resumed_samples()->set_index(2);  // past n
  expect_refused(samples, "resumed_samples");
  samples.clear_resumed_samples();
  for (int twice = 0; twice < 2; ++twice) samples.add_resumed_samples()->set_index(0);
  expect_refused(samples, "resumed_samples");
  auto one = TokenRequest({1, 2}, 4, 0.8f, 5);
  one.add_resumed_samples()->set_index(0);
  expect_refused(one, "resumed_samples");
  wv1::GenerateRequest text;  // the fixture has no tokenizer: a clear refusal
  text.set_text("hello");
  EXPECT_EQ(code_of(text).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  // The worker still serves.
  EXPECT_TRUE(StreamWorker(*stub_, TokenRequest({1, 2, 3}, 4, 0, 0)).status.ok());
}

TEST_F(WorkerProcess, InfoHealthAndDrain) {
  grpc::ClientContext c1;
  wv1::InfoResponse info;
  ASSERT_TRUE(stub_->Info(&c1, wv1::InfoRequest(), &info).ok());
  EXPECT_EQ(info.architecture(), "llama");
  EXPECT_EQ(info.num_layers(), 2);
  EXPECT_EQ(info.kv_transport(), "grpc");
  EXPECT_EQ(info.default_policy(), "full");
  EXPECT_EQ(info.backend(), "cpu-f32");
  EXPECT_EQ(info.max_running(), 16);
  EXPECT_EQ(testing::CheckHealth(channel_), grpc::health::v1::HealthCheckResponse::SERVING);
  // By the service's name too (grpc-health-probe -service, Kubernetes probes with `service:`).
  const std::string name = wv1::Worker::service_full_name();
  EXPECT_EQ(testing::CheckHealth(channel_, name), grpc::health::v1::HealthCheckResponse::SERVING);
  // SIGTERM during a stream: health NOT_SERVING, new requests UNAVAILABLE, the stream finishes.
  grpc::health::v1::HealthCheckResponse::ServingStatus during = {};
  grpc::Status refused;
  const auto prompt = RandomTokens(16, vocab(), 6);
  const StreamResult r =
      StreamWorker(*stub_, TokenRequest(prompt, 230, 0.0f, 0), nullptr, [&](int n) {
        if (n != 1) return;
        worker_->Signal(SIGTERM);
        for (int i = 0; i < 100; ++i) {  // the signal is handled asynchronously
          during = testing::CheckHealth(channel_);
          if (during == grpc::health::v1::HealthCheckResponse::NOT_SERVING) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        refused = StreamWorker(*stub_, TokenRequest(prompt, 4, 0.0f, 0)).status;
      });
  // The tiny model writes its 230 tokens into the transport's buffers in a few milliseconds,
  // so on a loaded machine the drain may be over, and the worker gone (no health answer at
  // all), before a probe sees NOT_SERVING; what must never be seen is SERVING.
  EXPECT_NE(during, grpc::health::v1::HealthCheckResponse::SERVING);
  if (during == grpc::health::v1::HealthCheckResponse::NOT_SERVING) {
    const auto after = testing::CheckHealth(channel_, name);
    EXPECT_NE(after, grpc::health::v1::HealthCheckResponse::SERVING);
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 230u) << "the running stream completes during the drain";
  EXPECT_EQ(worker_->Terminate(10), 0) << "the drained worker exits 0";
}

TEST_F(WorkerProcess, LoadingIsNotServingAndRefusesCallsUntilTheModelIsLoaded) {
  const int port = FreePort();
  ServerProcess loading(
      "infinigen-worker",
      {"--model=" + testing::FixturePath(kModel), "--listen=127.0.0.1:" + std::to_string(port),
       "--kv_transport=in-process", "--policy=full", "--threads=1", "--hold_loading_ms=20000"},
      port, /*ready=*/"");  // the port only: the model is not loaded yet (held 20 s). The
  // health service answers NOT_SERVING from the server's first call (gRPC's default one said
  // SERVING until the worker marked it otherwise, and a TSan build's first check landed there).
  ASSERT_TRUE(loading.running());
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stub = wv1::Worker::NewStub(channel);
  EXPECT_EQ(testing::CheckHealth(channel), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(testing::CheckHealth(channel, wv1::Worker::service_full_name()),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  const auto prompt = RandomTokens(8, vocab(), 3);
  const StreamResult early = StreamWorker(*stub, TokenRequest(prompt, 4, 0.0f, 0));
  EXPECT_EQ(early.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(early.status.error_message().find("loading"), std::string::npos)
      << early.status.error_message();
  grpc::ClientContext c;
  wv1::InfoResponse info;
  EXPECT_EQ(stub->Info(&c, wv1::InfoRequest(), &info).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(loading.Logged("infinigen-worker: serving"));
  // Then SERVING, and the same request streams what the local engine generates.
  auto health = grpc::health::v1::HealthCheckResponse::UNKNOWN;
  for (int i = 0; i < 1200 && health != grpc::health::v1::HealthCheckResponse::SERVING; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    health = testing::CheckHealth(channel);
  }
  ASSERT_EQ(health, grpc::health::v1::HealthCheckResponse::SERVING);
  const StreamResult r = StreamWorker(*stub, TokenRequest(prompt, 4, 0.0f, 0));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, Local(prompt, 4, 0.0f, 0));
}

}  // namespace
}  // namespace infinigen
