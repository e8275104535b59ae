// Prometheus families built by hand, for the collectables that read their figures at each scrape
// instead of keeping prometheus-cpp metrics (process_metrics.h, executor_metrics.h, the
// coordinator's per-job series in coordinator/service/job_series.h).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/metric_type.h"

namespace tessera {

inline prometheus::MetricFamily NewFamily(std::string name, std::string help,
                                          prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = type;
  return family;
}

// One sample of `family` with `labels`: a counter's or a gauge's value, as the family's type says.
inline prometheus::ClientMetric& AddSample(prometheus::MetricFamily& family,
                                           std::vector<prometheus::ClientMetric::Label> labels,
                                           double value) {
  prometheus::ClientMetric& metric = family.metric.emplace_back();
  metric.label = std::move(labels);
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  return metric;
}

}  // namespace tessera
