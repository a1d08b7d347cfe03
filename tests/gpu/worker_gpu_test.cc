// The worker service end to end on the GPU: infinigen-worker --device=cuda and infinigen-kvstore
// as real processes on 127.0.0.1 with the tiny Llama 3.1 fixture. In f32 the stream is exactly
// the CPU engine's greedy tokens, with the K/V going through the store, under the dense policy
// and under a host-side selection policy. Skipped without a GPU.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "infinigen/worker/v1/worker.grpc.pb.h"
#include "kernels/cuda/device.h"
#include "tests/support/fixture_model.h"
#include "tests/support/process.h"
#include "tests/support/test_paths.h"
#include "tests/support/worker_stream.h"

namespace infinigen {
namespace {

namespace wv1 = worker::v1;
using testing::FreePort;
using testing::ServerProcess;

const char* kModel = "hf/llama31_gqa";

// A greedy request for `max_new` tokens of `prompt` under `policy`, streamed to the end.
testing::WorkerStreamResult Stream(wv1::Worker::Stub& stub, const std::vector<int32_t>& prompt,
                                   int max_new, const std::string& policy) {
  return testing::StreamWorker(stub, testing::TokenRequest(prompt, max_new, 0.0f, 0, policy));
}

class WorkerOnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    const int store_port = FreePort();
    store_ = std::make_unique<ServerProcess>(
        "infinigen-kvstore",
        std::vector<std::string>{"--listen=127.0.0.1:" + std::to_string(store_port),
                                 "--capacity_mb=64", "--huge_pages=false"},
        store_port);
    ASSERT_TRUE(store_->running());
    const int port = FreePort();
    worker_ = std::make_unique<ServerProcess>(
        "infinigen-worker",
        std::vector<std::string>{
            "--model=" + testing::FixturePath(kModel), "--listen=127.0.0.1:" + std::to_string(port),
            "--kv_transport=grpc", "--kv_store=127.0.0.1:" + std::to_string(store_port),
            "--policy=full", "--device=cuda", "--cuda_dtype=f32"},
        port);
    ASSERT_TRUE(worker_->running()) << "see " << worker_->log_path();
    stub_ = wv1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                     grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<ServerProcess> store_, worker_;
  std::unique_ptr<wv1::Worker::Stub> stub_;
};

TEST_F(WorkerOnGpu, GreedyStreamIsTheCpuEnginesTokens) {
  testing::LoadedModel cpu = testing::LoadModel(testing::FixturePath(kModel));
  ASSERT_NE(cpu.model, nullptr);
  const auto prompt = testing::RandomTokens(37, cpu.model->config().vocab_size, 1);
  const auto want = testing::GreedyTokens(*cpu.model, prompt, 40);
  ASSERT_EQ(want.size(), 40u);
  const testing::WorkerStreamResult r = Stream(*stub_, prompt, 40, "full");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << " (log " << worker_->log_path() << ")";
  EXPECT_EQ(r.tokens, want);
}

// A host selection policy on the GPU worker (the model copies what it reads out of GPU memory).
// The prompt is shorter than the worker's --min_budget_tokens (256), so the window attends to
// every row and the stream is the dense greedy continuation; cuda_model_test checks sparse
// selections on the GPU against the CPU backend's.
TEST_F(WorkerOnGpu, HostSelectionPolicyStreamsOnTheGpu) {
  testing::LoadedModel cpu = testing::LoadModel(testing::FixturePath(kModel));
  ASSERT_NE(cpu.model, nullptr);
  const auto prompt = testing::RandomTokens(20, cpu.model->config().vocab_size, 2);
  const testing::WorkerStreamResult r = Stream(*stub_, prompt, 8, "window");
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << " (log " << worker_->log_path() << ")";
  EXPECT_EQ(r.tokens, testing::GreedyTokens(*cpu.model, prompt, 8));
}

}  // namespace
}  // namespace infinigen
