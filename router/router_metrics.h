// Prometheus metrics of the router: requests by final status code, failovers, tokens relayed,
// time to first token through the router, and (read at each scrape) streams in progress,
// requests queued and available workers.
#pragma once

#include <grpcpp/support/status_code_enum.h>

#include <memory>

#include "absl/status/statusor.h"
#include "common/metrics/exposer.h"

namespace prometheus {
class Counter;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace infinigen {

class Admission;
class WorkerPool;

class RouterMetrics {
 public:
  // Serves /metrics on `port` (all interfaces). `admission` and `pool` must outlive it.
  static absl::StatusOr<std::unique_ptr<RouterMetrics>> Start(int port, const Admission& admission,
                                                              const WorkerPool& pool);
  ~RouterMetrics();

  void RequestDone(grpc::StatusCode code);
  void Failover();
  void Resume();  // a failover that continued from the stored KV (no recompute)
  void Tokens(int n);
  void FirstToken(double seconds);

 private:
  RouterMetrics() = default;
  std::unique_ptr<MetricsExposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Counter* failovers_ = nullptr;
  prometheus::Counter* resumes_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Histogram* ttft_ = nullptr;
};

}  // namespace infinigen
