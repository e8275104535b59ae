// ExecutorMetrics: a daemon's CallExecutors (call_executor.h) as Prometheus families, read from
// each executor at every scrape:
//   tessera_call_executor_threads{executor}        gauge; its threads
//   tessera_call_executor_busy_threads{executor}   gauge; threads running a call's work now
//   tessera_call_executor_queued_calls{executor}   gauge; calls waiting for a thread now
//   tessera_call_executor_refused_total{executor}  counter; calls refused because the queue was
//                                                  full (RESOURCE_EXHAUSTED, retry after 1 s)
// `executor` is the executor's name ("client-calls", "node-calls"). Busy threads at the thread
// count with calls queued is a saturated daemon: its callers wait, then are refused.
//
// Thread safety: Collect may be called from any thread; the executors must outlive this object
// (register it with the daemon's exposer, which holds it weakly, and drop it first).
#pragma once

#include <vector>

#include "common/daemon/call_executor.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace tessera {

class ExecutorMetrics final : public prometheus::Collectable {
 public:
  // Null entries are skipped.
  explicit ExecutorMetrics(const std::vector<const CallExecutor*>& executors);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::vector<const CallExecutor*> executors_;
};

}  // namespace tessera
