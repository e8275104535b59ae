#include "coordinator/cluster/pass_counts.h"

#include <algorithm>
#include <utility>

#include "coordinator/jobs/attempt_policy.h"

namespace tessera::coordinator {

void CountClusterLocked(GuardedLedger::Hold& held, ClusterState& state, const NodeRegistry& nodes,
                        AttemptFate& fate, ClusterStats* stats) {
  // Counted in place: copying every node record (or capacity) here cost more than the pass.
  NodeRegistry::Tally tally = nodes.Count(held->Used());
  stats->nodes = std::move(tally.nodes);
  stats->gpus_total = tally.gpus_total;
  stats->gpus_allocated = tally.gpus_allocated;
  stats->cpu_slots_total = tally.cpu_slots_total;
  stats->cpu_slots_allocated = tally.cpu_slots_allocated;
  stats->restarts = fate.restarts();
  stats->failures = fate.failures();
  for (auto& [job_id, allocation] : held->all()) {
    if (allocation.phase() != Allocation::Phase::kRunning || allocation.rank_times.empty()) {
      continue;
    }
    std::vector<v1::RankStepTime> ranks;
    for (const auto& [rank, time] : allocation.rank_times) ranks.push_back(time);
    stats->stragglers[job_id] =
        ComputeStraggler(std::move(ranks), state.options.straggler_threshold);
  }
}

void CountQueues(const QueueConfig& config, const PassSnapshot& snapshot,
                 const std::vector<v1::Job>& waiting, const QueueStage& queue_stage,
                 const std::map<std::string, std::map<std::string, int64_t>>& preemptions,
                 ClusterStats* stats) {
  for (const QueueSpec& queue : config.queues) {
    ClusterStats::QueueFigures& figures = stats->queues[queue.name];
    figures.nominal = queue.nominal;
    if (auto it = snapshot.queue_use.find(queue.name); it != snapshot.queue_use.end()) {
      figures.used = it->second;
    }
    figures.borrowed.gpus = std::max<int64_t>(0, figures.used.gpus - queue.nominal.gpus);
    figures.borrowed.cpu_slots =
        std::max<int64_t>(0, figures.used.cpu_slots - queue.nominal.cpu_slots);
    figures.fair_share = queue_stage.Share(config, queue.name);
    if (auto it = preemptions.find(queue.name); it != preemptions.end()) {
      figures.preemptions = it->second;
    }
  }
  for (const v1::Job& job : waiting) {
    if (!snapshot.waiting.contains(job.job_id())) continue;
    auto it = stats->queues.find(CountingQueue(job.queue(), config));
    if (it != stats->queues.end()) ++it->second.waiting_jobs;
  }
}

}  // namespace tessera::coordinator
