// The OpenAI-compatible HTTP front door (docs/api.md, "OpenAI-compatible HTTP"): POST
// /v1/completions and /v1/chat/completions (whole, or streamed as server-sent events), GET
// /v1/models, vLLM's POST /tokenize and /detokenize, and GET /health. Every request becomes a call
// (a completions batch: one per prompt, openai/generate_calls.h) of the public gRPC API
// (infinigen.v1.Generation) on `channel`, the router's own in-process
// channel: API keys (the Authorization header is passed on), limits, admission, placement and
// failover are the gRPC API's, not a second copy of them. A client that disconnects cancels its
// generation. The connections (threads, limits, timeouts, TLS) are openai/http_server.h's.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/status/statusor.h"
#include "openai/http_server.h"

namespace infinigen::openai {

using HttpFrontDoorConfig = HttpServerConfig;

class HttpFrontDoor {
 public:
  static absl::StatusOr<std::unique_ptr<HttpFrontDoor>> Start(
      const HttpFrontDoorConfig& config, std::shared_ptr<grpc::Channel> channel);
  ~HttpFrontDoor();  // Shutdown()

  int port() const { return port_; }
  // Stops accepting, cancels the generations in progress, closes every connection and waits for
  // their threads.
  void Shutdown();

 private:
  class Impl;
  explicit HttpFrontDoor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace infinigen::openai
