#include "kv_store/service/kvstore_metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include "absl/strings/str_cat.h"
#include "common/metrics/family.h"

namespace infinigen {
namespace {

class StoreCollectable final : public prometheus::Collectable {
 public:
  explicit StoreCollectable(const KvStore& store) : store_(store) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    const KvStoreStats s = store_.Stats();
    using prometheus::MetricType;
    return {
        MetricFamilyOf("infinigen_kvstore_sequences", "Open sequences", MetricType::Gauge,
                       s.sequences),
        MetricFamilyOf("infinigen_kvstore_bytes_used", "Arena bytes in blocks", MetricType::Gauge,
                       s.bytes_used),
        MetricFamilyOf("infinigen_kvstore_bytes_free", "Arena bytes free", MetricType::Gauge,
                       s.bytes_capacity - s.bytes_used),
        MetricFamilyOf("infinigen_kvstore_tokens_stored", "Tokens stored (layer 0 rows)",
                       MetricType::Gauge, s.tokens_stored),
        MetricFamilyOf("infinigen_kvstore_appends_total", "Append calls", MetricType::Counter,
                       s.appends),
        MetricFamilyOf("infinigen_kvstore_gathers_total",
                       "Gathers the store served (shm clients copy rows themselves: not counted)",
                       MetricType::Counter, s.gathers),
        MetricFamilyOf("infinigen_kvstore_gathered_bytes_total", "K/V bytes served by gathers",
                       MetricType::Counter, s.bytes_gathered),
        MetricFamilyOf("infinigen_kvstore_evictions_total", "Tokens evicted by KV pools",
                       MetricType::Counter, s.evictions),
        MetricFamilyOf("infinigen_kvstore_rejections_total",
                       "Appends refused because the store was full", MetricType::Counter,
                       s.rejections),
        MetricFamilyOf("infinigen_kvstore_leases_expired_total", "Sequences freed by lease expiry",
                       MetricType::Counter, s.leases_expired),
    };
  }

 private:
  const KvStore& store_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvStoreMetrics>> KvStoreMetrics::Start(const KvStore& store,
                                                                      int port) {
  std::unique_ptr<KvStoreMetrics> m(new KvStoreMetrics());
  auto exposer = MetricsExposer::Start(port);
  if (!exposer.ok()) return exposer.status();
  m->exposer_ = std::move(*exposer);
  m->exposer_->Register(std::make_shared<StoreCollectable>(store));
  return m;
}

KvStoreMetrics::~KvStoreMetrics() = default;

}  // namespace infinigen
