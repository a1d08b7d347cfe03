#include "gpu_worker/service/worker_metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "common/metrics/family.h"

namespace infinigen {
namespace {

class EngineCollectable final : public prometheus::Collectable {
 public:
  explicit EngineCollectable(const BatchEngine& engine) : engine_(engine) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    const EngineStats s = engine_.Stats();
    using prometheus::MetricType;
    const double fraction =
        s.bytes_full > 0 ? static_cast<double>(s.bytes_fetched) / static_cast<double>(s.bytes_full)
                         : 1.0;
    return {
        MetricFamilyOf("infinigen_worker_running_requests", "Requests in the batch",
                       MetricType::Gauge, s.running),
        MetricFamilyOf("infinigen_worker_queued_requests", "Requests waiting for a batch slot",
                       MetricType::Gauge, s.queued),
        MetricFamilyOf("infinigen_worker_batch_size", "Sequences in the last step",
                       MetricType::Gauge, s.last_batch_sequences),
        MetricFamilyOf("infinigen_worker_steps_total", "Engine steps (forward passes)",
                       MetricType::Counter, s.steps),
        MetricFamilyOf("infinigen_worker_generated_tokens_total", "Tokens generated",
                       MetricType::Counter, s.generated_tokens),
        MetricFamilyOf("infinigen_worker_prompt_tokens_total", "Prompt tokens prefilled",
                       MetricType::Counter, s.prompt_tokens),
        MetricFamilyOf("infinigen_worker_requests_finished_total", "Requests that ended well",
                       MetricType::Counter, s.finished),
        MetricFamilyOf("infinigen_worker_requests_failed_total", "Requests that ended in error",
                       MetricType::Counter, s.failed),
        MetricFamilyOf("infinigen_worker_gather_wait_seconds_total",
                       "Time decode steps waited for KV rows from the store (finished requests)",
                       MetricType::Counter, s.gather_wait_seconds),
        MetricFamilyOf("infinigen_worker_kv_bytes_fetched_total",
                       "K/V bytes read from the store (finished requests)", MetricType::Counter,
                       s.bytes_fetched),
        MetricFamilyOf("infinigen_worker_kv_bytes_full_fetch_total",
                       "K/V bytes a full fetch would have read (finished requests)",
                       MetricType::Counter, s.bytes_full),
        MetricFamilyOf("infinigen_worker_kv_pool_evictions_total",
                       "Tokens the KV pool evicted to keep sequences within their share "
                       "(finished requests)",
                       MetricType::Counter, s.kv_pool_evictions),
        MetricFamilyOf("infinigen_worker_prefetch_hits_total",
                       "Decode steps whose selected rows had been prefetched during the previous "
                       "layer",
                       MetricType::Counter, s.prefetch_hits),
        MetricFamilyOf("infinigen_worker_prefetch_misses_total",
                       "Decode steps that fetched again because the selection left the "
                       "prefetched candidates",
                       MetricType::Counter, s.prefetch_misses),
        MetricFamilyOf("infinigen_worker_selection_fraction",
                       "Bytes fetched over a full fetch, over finished requests", MetricType::Gauge,
                       fraction),
    };
  }

 private:
  const BatchEngine& engine_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Start(const BatchEngine& engine,
                                                                    int port) {
  std::unique_ptr<WorkerMetrics> m(new WorkerMetrics());
  auto exposer = MetricsExposer::Start(port);
  if (!exposer.ok()) return exposer.status();
  m->exposer_ = std::move(*exposer);
  m->exposer_->Register(std::make_shared<EngineCollectable>(engine));
  m->registry_ = std::make_shared<prometheus::Registry>();
  const prometheus::Histogram::BucketBoundaries ttft = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                        1,    2.5,   5,    10,  30};
  const prometheus::Histogram::BucketBoundaries tpot = {0.001, 0.0025, 0.005, 0.01, 0.025,
                                                        0.05,  0.1,    0.25,  0.5,  1};
  m->latency_.time_to_first_token = &prometheus::BuildHistogram()
                                         .Name("infinigen_worker_time_to_first_token_seconds")
                                         .Help("Request received to first token")
                                         .Register(*m->registry_)
                                         .Add({}, ttft);
  m->latency_.time_per_output_token =
      &prometheus::BuildHistogram()
           .Name("infinigen_worker_time_per_output_token_seconds")
           .Help("Mean time between a request's tokens after the first")
           .Register(*m->registry_)
           .Add({}, tpot);
  m->exposer_->Register(m->registry_);
  return m;
}

WorkerMetrics::~WorkerMetrics() = default;

}  // namespace infinigen
