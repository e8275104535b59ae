// The snapshot stage of the scheduling pass: what the scheduling part of a pass starts from,
// taken in one short hold of the cluster lock and read without it afterwards. The waiting jobs
// that hold no devices, the nodes' capacity (shared, immutable: NodeRegistry::Summaries), the
// devices in use, the registry's generation (NodeRegistry::ChangedSince tells the reservation
// stage which nodes changed since), and with queues configured the queues in force and what each
// queue's allocations hold.
//
// Thread safety: TakePassSnapshotLocked needs the cluster lock; a PassSnapshot is a value.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/queues/queue_config.h"
#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

struct PassSnapshot {
  // Jobs PENDING or RESTARTING without an allocation.
  std::set<std::string> waiting;
  // Unset when nothing waits.
  std::shared_ptr<const std::vector<NodeCapacity>> summaries;
  UsedResources used;
  uint64_t generation = 0;
  // The queues in force for this pass, and the devices each queue's allocations hold (both only
  // when queues are configured: null and empty otherwise).
  std::shared_ptr<const QueueConfig> queues;
  std::map<std::string, Resources> queue_use;
};

// `waiting`: the PENDING and RESTARTING jobs (Store::ListWaitingJobs); `queues`: the
// configuration for this pass (QueueFile::Current, read before the lock), or null.
PassSnapshot TakePassSnapshotLocked(GuardedLedger::Hold& held, ClusterState& state,
                                    const NodeRegistry& nodes, const std::vector<v1::Job>& waiting,
                                    std::shared_ptr<const QueueConfig> queues);

}  // namespace tessera::coordinator
