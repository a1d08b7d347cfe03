// RunRelay: drives one stream's Relay (router/relay.h) against two seams, WorkerClient
// (placement and the streaming calls to workers) and ClientStream (the public call being
// answered). RouterService runs it over the WorkerPool and gRPC (router/pool_workers.h);
// tests run it over scripted fake workers (tests/unit/relay_test.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "infinigen/v1/generation.pb.h"
#include "infinigen/worker/v1/worker.pb.h"
#include "router/relay.h"

namespace infinigen {

class RouterMetrics;

// One streaming Generate call to a worker.
class WorkerCall {
 public:
  virtual ~WorkerCall() = default;
  virtual bool Read(worker::v1::GenerateResponse* message) = 0;  // false: the stream ended
  virtual void Cancel() = 0;          // end the call early (the client is gone)
  virtual absl::Status Finish() = 0;  // once Read returned false (or after Cancel)
  virtual bool stalled() const = 0;   // the call was cancelled because the worker went silent
};

// The workers as one request sees them.
class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  // An available worker not in `excluded` (placement's rule), by name; "" when there is none.
  virtual std::string Pick(absl::string_view session_id,
                           const std::vector<std::string>& excluded) = 0;
  // Starts a call to a worker Pick returned (null for any other: the call fails as INTERNAL);
  // `expected_tokens` is the load it adds to the worker until the call ends.
  virtual std::unique_ptr<WorkerCall> Call(absl::string_view worker,
                                           const worker::v1::GenerateRequest& request,
                                           int64_t expected_tokens) = 0;
  // The worker failed as a dead one fails: out of placement until it answers health checks.
  virtual void ReportFailure(absl::string_view worker) = 0;
};

// The public call the stream answers.
class ClientStream {
 public:
  virtual ~ClientStream() = default;
  virtual bool Write(const v1::GenerateResponse& message) = 0;  // false: the client is gone
  virtual bool Cancelled() = 0;
};

// Runs the stream to its end; returns the kFinish action (status and pushback). `metrics` may
// be null; `request_id` names the request in log lines.
RelayAction RunRelay(Relay& relay, WorkerClient& workers, ClientStream& client,
                     absl::string_view session_id, RouterMetrics* metrics,
                     absl::string_view request_id);

}  // namespace infinigen
