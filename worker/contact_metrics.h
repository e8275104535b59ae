// CoordinatorContactMetrics: the worker's /metrics view of its coordinator (the coordinator grace):
// tessera_worker_coordinator_reachable (1 while the leader answers, else 0) and
// tessera_worker_seconds_without_coordinator (since the leader last answered; 0 while it does), so
// that an alert fires well before the worker's coordinator grace stops its trainers.
//
// Thread safety: Collect may run on any thread; `contact` must be thread-safe.
#pragma once

#include <functional>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "worker/worker_agent.h"

namespace tessera::worker {

class CoordinatorContactMetrics final : public prometheus::Collectable {
 public:
  explicit CoordinatorContactMetrics(std::function<CoordinatorContact()> contact)
      : contact_(std::move(contact)) {}

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::function<CoordinatorContact()> contact_;
};

}  // namespace tessera::worker
