// The HTTP front door's calls of one request (openai/generate_calls.h) against a real gRPC
// server on 127.0.0.1 whose Generate streams as fast as it can: the messages of several calls
// all arrive, each with its call, then each call's end; and a queue nobody takes from (a
// streamed answer whose client stopped reading) is bounded: past max_queued_bytes every call is
// cancelled and the server sees it, with what was queued still there to take.
#include "openai/generate_calls.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace infinigen::openai {
namespace {

// Streams max_new_tokens messages of 64 KiB of text each (or until cancelled).
class Flood final : public v1::Generation::Service {
 public:
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    v1::GenerateResponse m;
    m.set_text(std::string(64 << 10, 'x'));
    m.set_index(request->sampling().n());  // echoes which request it is
    for (int i = 0; i < request->stopping().max_new_tokens() && !context->IsCancelled(); ++i) {
      if (!writer->Write(m)) break;
    }
    if (context->IsCancelled()) ++cancelled;
    ++ended;
    return grpc::Status::OK;
  }
  std::atomic<int> cancelled{0}, ended{0};
};

class GenerateCallsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&flood_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Generation::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }
  static std::vector<v1::GenerateRequest> Requests(int calls, int messages) {
    std::vector<v1::GenerateRequest> out(static_cast<size_t>(calls));
    for (int i = 0; i < calls; ++i) {
      out[i].mutable_sampling()->set_n(i);
      out[i].mutable_stopping()->set_max_new_tokens(messages);
    }
    return out;
  }
  Flood flood_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(GenerateCallsTest, EveryCallsMessagesThenItsEnd) {
  GenerateCalls calls(*stub_, Requests(3, 20), [](grpc::ClientContext&) {});
  std::vector<int> messages(3, 0), ends(3, 0);
  GenerateCalls::Event e;
  while (calls.Next(e)) {
    ASSERT_GE(e.call, 0);
    ASSERT_LT(e.call, 3);
    if (e.end) {
      EXPECT_TRUE(e.status.ok()) << e.status.error_message();
      EXPECT_EQ(messages[e.call], 20) << "the end after every message of call " << e.call;
      ++ends[e.call];
    } else {
      EXPECT_EQ(e.message.index(), e.call);
      ++messages[e.call];
    }
  }
  EXPECT_EQ(messages, std::vector<int>(3, 20));
  EXPECT_EQ(ends, std::vector<int>(3, 1));
  EXPECT_FALSE(calls.overflowed());
}

TEST_F(GenerateCallsTest, AQueueNobodyTakesFromIsBoundedAndCancelsEveryCall) {
  constexpr size_t kBound = 4 << 20;  // 64 messages
  GenerateCalls calls(
      *stub_, Requests(2, 100000), [](grpc::ClientContext&) {}, kBound);
  // Nothing taken: the servers' streams (6 GB each) stop when the bound is passed.
  for (int i = 0; i < 500 && flood_.ended.load() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(flood_.ended.load(), 2);
  EXPECT_EQ(flood_.cancelled.load(), 2);
  EXPECT_TRUE(calls.overflowed());
  size_t bytes = 0;
  int cancelled = 0;
  GenerateCalls::Event e;
  while (calls.Next(e)) {
    bytes += e.message.ByteSizeLong();
    if (e.end) cancelled += e.status.error_code() == grpc::StatusCode::CANCELLED;
  }
  EXPECT_EQ(cancelled, 2);
  EXPECT_GT(bytes, kBound);
  // Past the bound, what the transport had received already (its flow-control window).
  EXPECT_LT(bytes, kBound + (32 << 20)) << "the queue grew well past its bound";
}

}  // namespace
}  // namespace infinigen::openai
