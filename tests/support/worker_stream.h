// Reading a worker's Generate stream in tests: the token ids, the text deltas joined, the last
// message (usage, finish reason) and the final status.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "infinigen/worker/v1/worker.grpc.pb.h"

namespace infinigen::testing {

struct WorkerStreamResult {
  std::vector<int32_t> tokens;
  std::string text;
  worker::v1::GenerateResponse last;
  grpc::Status status;
};

// Streams `request` to the end. Without a `context`, one with a 120 s deadline is used;
// `on_token` (optional) is called with the number of tokens received after each message that
// carries tokens.
WorkerStreamResult StreamWorker(worker::v1::Worker::Stub& stub,
                                const worker::v1::GenerateRequest& request,
                                grpc::ClientContext* context = nullptr,
                                const std::function<void(int)>& on_token = {});

}  // namespace infinigen::testing
