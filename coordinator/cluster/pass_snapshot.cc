#include "coordinator/cluster/pass_snapshot.h"

#include <utility>

namespace tessera::coordinator {

PassSnapshot TakePassSnapshotLocked(GuardedLedger::Hold& held, ClusterState& state,
                                    const NodeRegistry& nodes, const std::vector<v1::Job>& waiting,
                                    std::shared_ptr<const QueueConfig> queues) {
  PassSnapshot snapshot;
  if (queues != nullptr && !queues->implicit()) {
    // Every allocation, draining ones included, holds its devices against its queue. The
    // ledger keeps the holds by the queue name the jobs were stored with; mapped here to the
    // queues in force, in O(queues) rather than O(allocations).
    for (const auto& [queue, hold] : held->HeldByQueue()) {
      snapshot.queue_use[CountingQueue(queue, *queues)] += hold.held;
    }
    snapshot.queues = std::move(queues);
  }
  for (const auto& job : waiting) {
    // A restarting job is listed while its failed attempt still drains.
    if (held->Find(job.job_id()) == nullptr) snapshot.waiting.insert(job.job_id());
  }
  if (snapshot.waiting.empty()) return snapshot;
  // The nodes (and their generation) from the registry, the devices in use from the ledger:
  // a node that changes after this is caught by the reservation (ChangedSince), and the ledger
  // gains allocations only from a pass.
  NodeRegistry::Snapshot registered = nodes.Summaries();
  snapshot.summaries = std::move(registered.summaries);
  snapshot.generation = registered.generation;
  snapshot.used = held->Used();
  return snapshot;
}

}  // namespace tessera::coordinator
