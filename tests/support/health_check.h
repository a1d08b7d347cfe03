// grpc.health.v1 as the tests ask it: one Check, and the shape every service of ours answers in
// (header-only: only the tests that link gRPC and the health proto include it).
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"

namespace infinigen::testing {

using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

// The status of `service` ("": the server as a whole) on `channel`; UNKNOWN when the call failed
// (its status in `failed`, when given). A deadline of 5 s.
inline ServingStatus CheckHealth(std::shared_ptr<grpc::Channel> channel,
                                 const std::string& service = "", grpc::Status* failed = nullptr) {
  auto stub = grpc::health::v1::Health::NewStub(std::move(channel));
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status st = stub->Check(&c, request, &response);
  if (failed != nullptr) *failed = st;
  return st.ok() ? response.status() : grpc::health::v1::HealthCheckResponse::UNKNOWN;
}

inline ServingStatus CheckHealth(const std::string& address, const std::string& service = "",
                                 grpc::Status* failed = nullptr) {
  return CheckHealth(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()), service,
                     failed);
}

// A service of ours answers SERVING for "" and for its public service's name, NOT_FOUND for a
// name it does not serve.
inline void ExpectHealthByServiceName(const std::string& address, const std::string& service) {
  for (const std::string& name : {std::string(), service}) {
    grpc::Status st;
    EXPECT_EQ(CheckHealth(address, name, &st), grpc::health::v1::HealthCheckResponse::SERVING)
        << "'" << name << "': " << st.error_message();
  }
  grpc::Status unknown;
  CheckHealth(address, "no.such.Service", &unknown);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND) << unknown.error_message();
}

}  // namespace infinigen::testing
