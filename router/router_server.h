// The router's gRPC server: infinigen.v1.Generation over a worker pool, with TLS (mTLS when a
// client CA is given), API keys, gRPC health and reflection, and Prometheus metrics.
// infinigen-router runs one over remote workers; `infinigen serve` runs one over the worker in
// its own process.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/tls_files.h"
#include "openai/http_front_door.h"
#include "router/router_metrics.h"
#include "router/router_service.h"
#include "router/worker_pool.h"

namespace infinigen {

struct RouterServerConfig {
  std::string listen = "127.0.0.1:50051";
  TlsFiles tls;               // serving: cert, key, and ca = the client CA (mTLS)
  std::string api_keys_file;  // empty: no authentication
  int metrics_port = 0;       // 0: off
  // The OpenAI-compatible HTTP front door (openai/http_front_door.h); empty listen: off.
  std::string http_listen;
  openai::HttpFrontDoorConfig http;
  RouterOptions options;
  WorkerPoolConfig pool;
};

class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Start(RouterServerConfig config);
  ~RouterServer();

  int port() const { return port_; }
  int http_port() const { return http_ != nullptr ? http_->port() : 0; }
  int available_workers() const { return pool_->available(); }
  // Health NOT_SERVING, then waits up to `timeout` for the streams in progress to end.
  void Drain(absl::Duration timeout);
  void Shutdown(absl::Duration grace);

 private:
  RouterServer() = default;
  std::optional<ApiKeys> api_keys_;
  std::unique_ptr<WorkerPool> pool_;
  std::unique_ptr<RouterService> service_;
  // Calls to methods the server does not have: UNIMPLEMENTED, as without it. gRPC requires one
  // because RouterService re-registers two of its methods (marked generic) with UTF-8 checks.
  std::unique_ptr<grpc::CallbackGenericService> unknown_methods_;
  std::unique_ptr<RouterMetrics> metrics_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<openai::HttpFrontDoor> http_;  // calls server_ over its in-process channel
};

}  // namespace infinigen
