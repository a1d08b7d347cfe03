// Streams through the public API (infinigen.v1) for failover tests: one stream read to the end,
// and several at once with a fault injected once every one of them is under way.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <vector>

#include "infinigen/v1/generation.grpc.pb.h"

namespace infinigen::testing {

struct PublicStreamResult {
  std::vector<int32_t> tokens;
  v1::GenerateResponse last;
  grpc::Status status;
};

struct StreamAllOptions {
  std::chrono::seconds deadline{90};       // each stream's
  int started_after = 3;                   // tokens that make a stream count as under way
  std::chrono::seconds wait_for_start{4};  // how long to wait for every stream to be under way
};

// One stream read to the end, with `deadline`.
PublicStreamResult StreamOne(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                             std::chrono::seconds deadline = std::chrono::seconds(90));

// The streams at once; `fault` runs once every one has `started_after` tokens (or the wait is
// over: a failed expectation then says that some streams were not under way).
std::vector<PublicStreamResult> StreamAll(v1::Generation::Stub& stub,
                                          const std::vector<v1::GenerateRequest>& requests,
                                          const std::function<void()>& fault,
                                          const StreamAllOptions& options = {});

}  // namespace infinigen::testing
