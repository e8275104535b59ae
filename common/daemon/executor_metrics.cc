#include "common/daemon/executor_metrics.h"

#include <string>
#include <utility>

#include "common/daemon/metric_families.h"

namespace tessera {
namespace {

void Add(prometheus::MetricFamily& family, const std::string& executor, double value) {
  AddSample(family, {{"executor", executor}}, value);
}

std::vector<const CallExecutor*> NonNull(const std::vector<const CallExecutor*>& executors) {
  std::vector<const CallExecutor*> kept;
  for (const CallExecutor* executor : executors) {
    if (executor != nullptr) kept.push_back(executor);
  }
  return kept;
}

}  // namespace

ExecutorMetrics::ExecutorMetrics(const std::vector<const CallExecutor*>& executors)
    : executors_(NonNull(executors)) {}

std::vector<prometheus::MetricFamily> ExecutorMetrics::Collect() const {
  prometheus::MetricFamily threads =
      NewFamily("tessera_call_executor_threads", "Threads of a call executor.",
                prometheus::MetricType::Gauge);
  prometheus::MetricFamily busy = NewFamily("tessera_call_executor_busy_threads",
                                            "Threads of a call executor running a call's work now.",
                                            prometheus::MetricType::Gauge);
  prometheus::MetricFamily queued = NewFamily("tessera_call_executor_queued_calls",
                                              "Calls waiting for a thread of a call executor now.",
                                              prometheus::MetricType::Gauge);
  prometheus::MetricFamily refused =
      NewFamily("tessera_call_executor_refused_total",
                "Calls a call executor refused because its queue was full (told to retry).",
                prometheus::MetricType::Counter);
  for (const CallExecutor* executor : executors_) {
    const CallExecutor::Load load = executor->load();
    Add(threads, executor->name(), executor->threads());
    Add(busy, executor->name(), load.busy_threads);
    Add(queued, executor->name(), load.queued);
    Add(refused, executor->name(), static_cast<double>(load.refused));
  }
  std::vector<prometheus::MetricFamily> families;
  if (executors_.empty()) return families;
  for (prometheus::MetricFamily* family : {&threads, &busy, &queued, &refused}) {
    families.push_back(std::move(*family));
  }
  return families;
}

}  // namespace tessera
