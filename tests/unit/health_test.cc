// The health service every server runs (common/grpc/health): a real gRPC server on 127.0.0.1
// and the grpc.health.v1 client. Not serving from the first call until SetHealth says so (gRPC's
// default service said SERVING at once), names it was not told of are NOT_FOUND, Watch streams
// each change, and a server with an open Watch still shuts down at its deadline.
#include "common/grpc/health.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "grpc/health/v1/health.grpc.pb.h"

namespace infinigen {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

class HealthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    AddHealthService(builder);
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    stub_ = Health::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  // The status of `service`, or the call's error code as a negative number.
  int Check(const std::string& service) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    const grpc::Status status = stub_->Check(&context, request, &response);
    return status.ok() ? static_cast<int>(response.status()) : -status.error_code();
  }

  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthTest, TheServerIsNotServingUntilItSaysSo) {
  EXPECT_EQ(Check(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Check("pkg.Service"), -grpc::StatusCode::NOT_FOUND);
  SetHealth(*server_, {"pkg.Service"}, false);
  EXPECT_EQ(Check("pkg.Service"), HealthCheckResponse::NOT_SERVING);
  SetHealth(*server_, {"pkg.Service"}, true);
  EXPECT_EQ(Check(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Check("pkg.Service"), HealthCheckResponse::SERVING);
  EXPECT_EQ(Check("pkg.Other"), -grpc::StatusCode::NOT_FOUND);
  SetHealth(*server_, {"pkg.Service"}, false);  // draining
  EXPECT_EQ(Check(""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Check("pkg.Service"), HealthCheckResponse::NOT_SERVING);
}

TEST_F(HealthTest, WatchStreamsEachChangeAndUnknownNames) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  HealthCheckRequest request;
  request.set_service("pkg.Service");
  auto reader = stub_->Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVICE_UNKNOWN);
  SetHealth(*server_, {"pkg.Service"}, false);
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  SetHealth(*server_, {"pkg.Service"}, false);  // no change: nothing is sent
  SetHealth(*server_, {"pkg.Service"}, true);
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  context.TryCancel();
  EXPECT_FALSE(reader->Read(&response));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(HealthTest, AnOpenWatchEndsWithTheServersShutdown) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub_->Watch(&context, HealthCheckRequest());
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  const auto start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(5)) << "the watch held the server past its deadline";
  while (reader->Read(&response)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
  server_.reset();
}

}  // namespace
}  // namespace infinigen
