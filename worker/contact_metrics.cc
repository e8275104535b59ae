#include "worker/contact_metrics.h"

namespace tessera::worker {
namespace {

prometheus::MetricFamily Gauge(const char* name, const char* help, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = prometheus::MetricType::Gauge;
  prometheus::ClientMetric& metric = family.metric.emplace_back();
  metric.gauge.value = value;
  return family;
}

}  // namespace

std::vector<prometheus::MetricFamily> CoordinatorContactMetrics::Collect() const {
  const CoordinatorContact contact = contact_();
  return {Gauge("tessera_worker_coordinator_reachable",
                "1 while the leading coordinator answers this worker's heartbeats, else 0",
                contact.reachable ? 1 : 0),
          Gauge("tessera_worker_seconds_without_coordinator",
                "Seconds since the leading coordinator last answered this worker (0 while it "
                "does); past --coordinator_grace the worker checkpoints and stops its trainers",
                absl::ToDoubleSeconds(contact.without))};
}

}  // namespace tessera::worker
