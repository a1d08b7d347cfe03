// Prometheus metrics of a worker: engine counters read at every scrape (batch size, tokens,
// steps, gather wait, bytes fetched vs a full fetch, selection fraction) and histograms of time
// to first token and time per output token observed as requests finish.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/metrics/exposer.h"
#include "gpu_worker/engine/batch_engine.h"
#include "gpu_worker/service/worker_service.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace infinigen {

class WorkerMetrics {
 public:
  // Serves /metrics on `port` (all interfaces).
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Start(const BatchEngine& engine, int port);
  ~WorkerMetrics();
  // For WorkerService::SetLatencyMetrics.
  WorkerLatencyMetrics latency() const { return latency_; }

 private:
  WorkerMetrics() = default;
  std::unique_ptr<MetricsExposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  WorkerLatencyMetrics latency_;
};

}  // namespace infinigen
