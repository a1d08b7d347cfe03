// Prometheus metrics of the KV store, read from KvStore::Stats() at every scrape.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "common/metrics/exposer.h"
#include "kv_store/kv_store.h"

namespace infinigen {

class KvStoreMetrics {
 public:
  // Serves /metrics on `port` (all interfaces).
  static absl::StatusOr<std::unique_ptr<KvStoreMetrics>> Start(const KvStore& store, int port);
  ~KvStoreMetrics();

 private:
  KvStoreMetrics() = default;
  std::unique_ptr<MetricsExposer> exposer_;
};

}  // namespace infinigen
