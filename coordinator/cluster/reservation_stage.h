// The reservation stage of the scheduling pass: the gangs the scheduler placed become
// allocations. MakeAssignments builds each placement's orders without the cluster lock (the spec
// and plan copied for every node, the data its job's rollbacks skipped, for a restart the step
// its metrics are complete through: one store read); ReserveLocked, in one short hold, records
// the allocation of each gang whose nodes did not change since the snapshot (a node that
// registered again, or was lost, may offer other devices now: that gang waits for the next pass),
// names each GPU rank's device, picks its master port and queues its orders held back: they go
// out to their nodes only once the placement is stored (store_stage.h), so that no worker starts
// a task the store does not know and no heartbeat waits for the store.
//
// Only a pass adds or frees allocations and passes are serialized, so the other gangs' devices
// are still free at reservation.
//
// Thread safety: MakeAssignments without the cluster lock, ReserveLocked with it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

// What the stage reads of the pass's waiting jobs, by job id (PlannedJobs, plan_stage.h).
struct PlacedJobs {
  const std::map<std::string, const v1::Job*>& jobs;
  const std::map<std::string, v1::JobSpec>& specs;
  const std::map<std::string, v1::LayoutPlan>& plans;
};

// Each placement's orders by node, in the order of `placed`.
std::vector<std::map<std::string, v1::TaskAssignment>> MakeAssignments(
    const ClusterState& state, const std::vector<GangPlacement>& placed, const PlacedJobs& jobs);

struct Reservation {
  // The placements reserved (pointers into `placed`), and each one's master port by job.
  std::vector<const GangPlacement*> placements;
  std::map<std::string, int> master_ports;
};

// `assignments`: MakeAssignments' (moved from); `generation`: the snapshot's
// (NodeRegistry::generation). Names the GPU ranks of `placed` in place.
Reservation ReserveLocked(GuardedLedger::Hold& held, ClusterState& state, const NodeRegistry& nodes,
                          std::vector<GangPlacement>& placed, uint64_t generation,
                          const PlacedJobs& jobs,
                          std::vector<std::map<std::string, v1::TaskAssignment>> assignments);

}  // namespace tessera::coordinator
