// The OpenAI-compatible HTTP front door (docs/api.md, "OpenAI-compatible HTTP"): POST
// /v1/completions and /v1/chat/completions (whole, or streamed as server-sent events), GET
// /v1/models and GET /health, on Boost.Beast. Every request becomes a call of the public gRPC API
// (infinigen.v1.Generation) on `channel`, the router's own in-process channel: API keys (the
// Authorization header is passed on), limits, admission, placement and failover are the gRPC
// API's, not a second copy of them. A client that disconnects cancels its generation.
//
// One thread per connection (keep-alive: requests one after another), at most max_connections
// (more are answered 503 and closed); a connection that sends no whole request within
// idle_timeout is closed.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace infinigen::openai {

struct HttpFrontDoorConfig {
  std::string listen = "127.0.0.1:8000";  // host:port (port 0: any free one)
  int max_connections = 256;
  size_t max_body_bytes = 4 << 20;  // larger requests: 413
  // A connection that has not sent a whole request this long after the last answer (or its
  // opening) is closed: idle keep-alive connections and slow senders do not hold threads.
  absl::Duration idle_timeout = absl::Seconds(60);
};

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
