#include "coordinator/cluster/queue_status.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tessera::coordinator {
namespace {

void SetResources(const Resources& resources, v1::QueueResources* out) {
  out->set_gpus(resources.gpus);
  out->set_cpu_slots(resources.cpu_slots);
}

void SetFigures(const ClusterStats::QueueFigures& figures, v1::QueueStatus* status) {
  SetResources(figures.used, status->mutable_used());
  SetResources(figures.borrowed, status->mutable_borrowed());
  status->set_fair_share(figures.fair_share);
  status->set_pending_jobs(static_cast<int32_t>(figures.waiting_jobs));
  status->set_running_jobs(static_cast<int32_t>(figures.running_jobs));
  int64_t preemptions = 0;
  for (const auto& [reason, count] : figures.preemptions) preemptions += count;
  status->set_preemptions(preemptions);
}

}  // namespace

v1::ListQueuesResponse QueueStatuses(
    const QueueConfig& config, const std::map<std::string, ClusterStats::QueueFigures>& figures,
    const std::string& queue_file) {
  v1::ListQueuesResponse response;
  response.set_queue_file(queue_file);
  const ClusterStats::QueueFigures none;
  auto figures_of = [&](const std::string& name) -> const ClusterStats::QueueFigures& {
    auto it = figures.find(name);
    return it == figures.end() ? none : it->second;
  };
  if (config.implicit()) {
    v1::QueueStatus* status = response.add_queues();
    status->set_name(std::string(kImplicitQueue));
    status->set_weight(1.0);
    status->mutable_nominal();
    SetFigures(figures_of(status->name()), status);
    return response;
  }
  std::vector<const QueueSpec*> queues;
  for (const QueueSpec& queue : config.queues) queues.push_back(&queue);
  std::sort(queues.begin(), queues.end(),
            [](const QueueSpec* a, const QueueSpec* b) { return a->name < b->name; });
  for (const QueueSpec* queue : queues) {
    v1::QueueStatus* status = response.add_queues();
    status->set_name(queue->name);
    status->set_cohort(queue->cohort);
    SetResources(queue->nominal, status->mutable_nominal());
    if (queue->borrowing_limit_gpus.has_value()) {
      status->set_borrowing_limit_gpus(*queue->borrowing_limit_gpus);
    }
    if (queue->borrowing_limit_cpu_slots.has_value()) {
      status->set_borrowing_limit_cpu_slots(*queue->borrowing_limit_cpu_slots);
    }
    status->set_weight(queue->weight);
    SetFigures(figures_of(queue->name), status);
  }
  return response;
}

}  // namespace tessera::coordinator
