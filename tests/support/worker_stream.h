// A worker's Generate stream in tests: building a token-id request, and reading the stream:
// the token ids, the text deltas joined, the last message (usage, finish reason) and the final
// status.
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

// A request for `max_new` tokens after the token ids `prompt`, EOS ignored: greedy at
// temperature 0, else top-k 30 with `seed`; `policy` empty keeps the worker's default.
worker::v1::GenerateRequest TokenRequest(const std::vector<int32_t>& prompt, int max_new,
                                         float temperature = 0.0f, uint64_t seed = 0,
                                         const std::string& policy = "");

// Streams `request` to the end. Without a `context`, one with a 120 s deadline is used;
// `on_token` (optional) is called with the number of tokens received after each message that
// carries tokens.
WorkerStreamResult StreamWorker(worker::v1::Worker::Stub& stub,
                                const worker::v1::GenerateRequest& request,
                                grpc::ClientContext* context = nullptr,
                                const std::function<void(int)>& on_token = {});

}  // namespace infinigen::testing
