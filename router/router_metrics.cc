#include "router/router_metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "common/metrics/family.h"
#include "router/admission.h"
#include "router/worker_pool.h"

namespace infinigen {
namespace {

class RouterCollectable final : public prometheus::Collectable {
 public:
  RouterCollectable(const Admission& admission, const WorkerPool& pool)
      : admission_(admission), pool_(pool) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    return {
        MetricFamilyOf("infinigen_router_streams", "Requests being relayed to workers",
                       MetricType::Gauge, admission_.streams()),
        MetricFamilyOf("infinigen_router_queued_requests", "Requests waiting for a slot",
                       MetricType::Gauge, admission_.queued()),
        MetricFamilyOf("infinigen_router_available_workers",
                       "Workers whose health check says SERVING", MetricType::Gauge,
                       pool_.available()),
    };
  }

 private:
  const Admission& admission_;
  const WorkerPool& pool_;
};

const char* CodeName(grpc::StatusCode c) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int i = static_cast<int>(c);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN";
}

}  // namespace

absl::StatusOr<std::unique_ptr<RouterMetrics>> RouterMetrics::Start(int port,
                                                                    const Admission& admission,
                                                                    const WorkerPool& pool) {
  std::unique_ptr<RouterMetrics> m(new RouterMetrics());
  auto exposer = MetricsExposer::Start(port);
  if (!exposer.ok()) return exposer.status();
  m->exposer_ = std::move(*exposer);
  m->exposer_->Register(std::make_shared<RouterCollectable>(admission, pool));
  m->registry_ = std::make_shared<prometheus::Registry>();
  m->requests_ = &prometheus::BuildCounter()
                      .Name("infinigen_router_requests_total")
                      .Help("Generate requests by final gRPC status code")
                      .Register(*m->registry_);
  m->failovers_ = &prometheus::BuildCounter()
                       .Name("infinigen_router_failovers_total")
                       .Help("Streams moved to another worker after theirs failed")
                       .Register(*m->registry_)
                       .Add({});
  m->resumes_ = &prometheus::BuildCounter()
                     .Name("infinigen_router_resumes_total")
                     .Help(
                         "Failovers whose new worker took the stream's KV over from the store "
                         "instead of recomputing it (the others replayed)")
                     .Register(*m->registry_)
                     .Add({});
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("infinigen_router_tokens_total")
                    .Help("Tokens relayed to clients")
                    .Register(*m->registry_)
                    .Add({});
  m->ttft_ = &prometheus::BuildHistogram()
                  .Name("infinigen_router_time_to_first_token_seconds")
                  .Help("Request admitted to first token relayed")
                  .Register(*m->registry_)
                  .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.025, 0.05, 0.1, 0.25,
                                                                   0.5, 1, 2.5, 5, 10, 30});
  m->exposer_->Register(m->registry_);
  return m;
}

RouterMetrics::~RouterMetrics() = default;

void RouterMetrics::RequestDone(grpc::StatusCode code) {
  requests_->Add({{"code", CodeName(code)}}).Increment();
}
void RouterMetrics::Failover() { failovers_->Increment(); }
void RouterMetrics::Resume() { resumes_->Increment(); }
void RouterMetrics::Tokens(int n) { tokens_->Increment(n); }
void RouterMetrics::FirstToken(double seconds) { ttft_->Observe(seconds); }

}  // namespace infinigen
