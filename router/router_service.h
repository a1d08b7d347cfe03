// infinigen.v1.Generation over a pool of workers: authenticates (API keys), validates against
// the router's limits, admits (bounded streams and queue), places each request on a worker and
// relays its stream. A worker that fails before the first token is replaced transparently; one
// that dies mid-stream, or stops sending (frozen: StallWatchdog), is replaced by another that
// takes the stream's KV over from the store, or else recomputes the prompt plus the tokens
// already sent (same seed, so the same continuation), with no token repeated or lost; the rules
// are router/relay.h's, run over the pool by router/relay_driver.h. GetModelInfo answers from the
// pool's state, never waiting on a worker.
#pragma once

#include <memory>
#include <string>

#include "frontend/request_validation.h"
#include "infinigen/v1/generation.grpc.pb.h"
#include "router/admission.h"
#include "router/api_keys.h"
#include "router/key_limits.h"
#include "router/stall_watchdog.h"
#include "router/worker_pool.h"

namespace infinigen {

class RouterMetrics;

struct RouterOptions {
  int max_streams = 256;  // requests relayed at once
  int max_queued = 1024;  // requests waiting for one of those
  // What a request may ask (frontend/request_validation.h), checked before it is queued. A
  // request without max_new_tokens is sent to the workers with limits.DefaultMaxNewTokens(),
  // so that the admission's sizing and the worker agree.
  RequestLimits limits;
  int max_attempts = 4;  // worker calls per request that may fail (first try included)
  // How long a stream whose worker died waits for a worker to resume it when none is available
  // (from its first failover).
  absl::Duration resume_wait = absl::Seconds(10);
  // When a stream whose worker sends nothing is moved to another one (router/stall_watchdog.h).
  StallRules stall;
  // A failover hands the stream's KV in the store to the next worker (resume without
  // recompute); false: the next worker always replays (recomputes) the prompt and tokens sent.
  bool resume_from_store = true;
  const ApiKeys* api_keys = nullptr;  // null: no authentication
  KeyLimitsConfig key_limits;         // per API key (with api_keys only)

  absl::Status Validate() const;
};

class RouterService final : public v1::Generation::Service {
 public:
  RouterService(WorkerPool& pool, const RouterOptions& options);

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;

  const Admission& admission() const { return admission_; }
  // Optional; set before serving.
  void SetMetrics(RouterMetrics* metrics) { metrics_ = metrics; }

 private:
  // OK (and the key's index in *key, -1 without keys) or UNAUTHENTICATED.
  grpc::Status Authenticate(const grpc::ServerContext& context, int* key = nullptr) const;
  grpc::Status Validate(const v1::GenerateRequest& request) const;
  // What a relayed stream did, for its log line.
  struct RelayStats {
    int64_t tokens = 0;
    int failovers = 0;
    int resumes = 0;  // failovers that took the KV over from the store
  };
  grpc::Status RelayStream(grpc::ServerContext* context, const v1::GenerateRequest& request,
                           const std::string& request_id,
                           grpc::ServerWriter<v1::GenerateResponse>* writer, RelayStats& stats);

  WorkerPool& pool_;
  const RouterOptions options_;
  Admission admission_;
  std::unique_ptr<KeyLimits> key_limits_;  // with api_keys and a per-key limit
  StallWatchdog watchdog_;
  RouterMetrics* metrics_ = nullptr;
};

}  // namespace infinigen
