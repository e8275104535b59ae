// Priority preemption when the cluster is full: which running jobs of a waiting job's own queue,
// of strictly lower priority, to stop so that its gang fits the devices they would leave. The
// other half of preemption beside queue_preemption.h (which acts when a queue's quota holds a job
// back): Kueue's rule within a ClusterQueue (withinClusterQueue: LowerPriority). It applies with
// or without a queue file (without one every job is in the queue "default"). The decision only;
// pure logic over the gang scheduler (scheduler.h): no gRPC, store, threads or clock.
//
// Policy, for the waiting job's resource (GPUs or CPU slots):
// * Candidates are the running jobs of the waiting job's queue with a strictly lower priority
//   holding that resource. A job of another queue, or of equal or higher priority, is never one.
// * They are taken in queue_preemption.h's victim order (lowest priority, then least progress
//   lost, then larger, then job_id), and the shortest prefix of that order after which the gang
//   scheduler places the waiting gang on the free devices plus theirs is returned: every victim
//   is needed up to the last one taken, and a set that would still leave the gang unplaced
//   (another node, another GPU type, too few per node) is never returned.
//
// Thread safety: a pure function.
#pragma once

#include <string>
#include <vector>

#include "coordinator/queues/queue_preemption.h"
#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// A running job with the devices it holds (not owned: the allocation's), for
// SelectCapacityPreemption.
struct RunningGang {
  RunningJob job;
  const std::vector<v1::RankPlacement>* ranks = nullptr;
};

// The victims that let `waiting` (of queue `queue`) start on `capacity` (the free devices now)
// by the policy above; none, with the reason, when no such set exists.
PreemptionDecision SelectCapacityPreemption(const std::vector<RunningGang>& running,
                                            const GangRequest& waiting, const std::string& queue,
                                            const std::vector<NodeCapacity>& capacity);

}  // namespace tessera::coordinator
