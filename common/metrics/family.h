// A one-sample Prometheus metric family, for collectables that read a service's counters at
// every scrape.
#pragma once

#include <prometheus/metric_family.h>

#include <string>

namespace infinigen {

prometheus::MetricFamily MetricFamilyOf(const std::string& name, const std::string& help,
                                        prometheus::MetricType type, double value);

}  // namespace infinigen
