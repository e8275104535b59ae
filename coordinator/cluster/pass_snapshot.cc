#include "coordinator/cluster/pass_snapshot.h"

#include <utility>

namespace tessera::coordinator {

PassSnapshot TakePassSnapshotLocked(ClusterState& state, const std::vector<v1::Job>& waiting,
                                    std::shared_ptr<const QueueConfig> queues) {
  PassSnapshot snapshot;
  if (queues != nullptr && !queues->implicit()) {
    // Every allocation, draining ones included, holds its devices against its queue. The
    // ledger keeps the holds by the queue name the jobs were stored with; mapped here to the
    // queues in force, in O(queues) rather than O(allocations).
    for (const auto& [queue, hold] : state.allocations.HeldByQueue()) {
      snapshot.queue_use[CountingQueue(queue, *queues)] += hold.held;
    }
    snapshot.queues = std::move(queues);
  }
  for (const auto& job : waiting) {
    // A restarting job is listed while its failed attempt still drains.
    if (state.allocations.Find(job.job_id()) == nullptr) snapshot.waiting.insert(job.job_id());
  }
  if (snapshot.waiting.empty()) return snapshot;
  snapshot.summaries = state.nodes.Summaries();
  snapshot.used = state.allocations.Used();
  snapshot.generation = state.nodes.generation();
  return snapshot;
}

}  // namespace tessera::coordinator
