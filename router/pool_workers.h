// PoolWorkers: the relay's WorkerClient (router/relay_driver.h) over the router's WorkerPool and
// gRPC, for one public call: placement by the pool's rule, worker calls that inherit the client's
// deadline and cancellation and are watched by the StallWatchdog, and the placement load (each
// call's expected tokens, released as tokens arrive and when it ends).
#pragma once

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "router/relay_driver.h"
#include "router/stall_watchdog.h"
#include "router/worker_pool.h"

namespace infinigen {

class PoolWorkers final : public WorkerClient {
 public:
  // All three must outlive it; `context` is the public call's.
  PoolWorkers(WorkerPool& pool, StallWatchdog& watchdog, grpc::ServerContext& context)
      : pool_(pool), watchdog_(watchdog), context_(context) {}

  std::string Pick(absl::string_view session_id, const std::vector<std::string>& excluded) override;
  std::unique_ptr<WorkerCall> Call(absl::string_view worker,
                                   const worker::v1::GenerateRequest& request,
                                   int64_t expected_tokens) override;
  void ReportFailure(absl::string_view worker) override;

 private:
  WorkerPool& pool_;
  StallWatchdog& watchdog_;
  grpc::ServerContext& context_;
  // The workers this request was placed on, by address (kept alive: excluded ones are compared
  // by identity).
  std::map<std::string, std::shared_ptr<PooledWorker>, std::less<>> picked_;
};

}  // namespace infinigen
