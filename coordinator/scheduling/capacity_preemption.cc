#include "coordinator/scheduling/capacity_preemption.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::coordinator {
namespace {

// `capacity` with `ranks`' devices free again.
void Free(const std::vector<v1::RankPlacement>& ranks, std::vector<NodeCapacity>& capacity) {
  for (const v1::RankPlacement& rank : ranks) {
    for (NodeCapacity& node : capacity) {
      if (node.node_id != rank.node_id()) continue;
      if (rank.gpu_index() >= 0) {
        node.free_gpus.push_back(rank.gpu_index());
      } else {
        ++node.free_cpu_slots;
      }
    }
  }
}

bool Fits(const GangRequest& waiting, std::vector<NodeCapacity> capacity) {
  return !Schedule({waiting}, std::move(capacity)).placed.empty();
}

}  // namespace

PreemptionDecision SelectCapacityPreemption(const std::vector<RunningGang>& running,
                                            const GangRequest& waiting, const std::string& queue,
                                            const std::vector<NodeCapacity>& capacity) {
  PreemptionDecision decision;
  std::vector<const RunningGang*> candidates;
  for (const RunningGang& gang : running) {
    if (gang.job.queue == queue && gang.job.priority < waiting.priority &&
        gang.job.use_gpus == waiting.use_gpus) {
      candidates.push_back(&gang);
    }
  }
  if (candidates.empty()) {
    decision.reason = absl::StrCat("no running job of queue ", queue, " has a lower priority than ",
                                   waiting.priority);
    return decision;
  }
  std::sort(candidates.begin(), candidates.end(), [](const RunningGang* a, const RunningGang* b) {
    return VictimBefore(a->job, b->job);
  });
  std::vector<NodeCapacity> freed = capacity;
  // The scheduler is asked only once enough devices are free in all: a pass must stay cheap with
  // many running jobs on many nodes.
  int64_t available = 0;
  for (const NodeCapacity& node : capacity) {
    if (!node.schedulable) continue;
    available +=
        waiting.use_gpus ? static_cast<int64_t>(node.free_gpus.size()) : node.free_cpu_slots;
  }
  std::vector<Victim> victims;
  for (const RunningGang* gang : candidates) {
    Free(*gang->ranks, freed);
    available += static_cast<int64_t>(gang->ranks->size());
    victims.push_back(
        {gang->job.job_id, PreemptionKind::kPriority,
         absl::StrCat("preempted by higher-priority ", waiting.job_id, " (priority ",
                      waiting.priority, ") in queue ", queue,
                      ", which the full cluster cannot place; ", DescribeVictim(gang->job))});
    if (available >= waiting.world_size && Fits(waiting, freed)) {
      decision.victims = std::move(victims);
      decision.reason =
          absl::StrCat("preempt ", decision.victims.size(), " lower-priority job(s) of queue ",
                       queue, " for ", waiting.job_id, ": the cluster has no room for its ",
                       waiting.world_size, waiting.use_gpus ? " GPU(s)" : " CPU slot(s)");
      return decision;
    }
  }
  decision.reason = absl::StrCat("preempting every lower-priority job of queue ", queue,
                                 " would not make room for ", waiting.job_id);
  return decision;
}

}  // namespace tessera::coordinator
