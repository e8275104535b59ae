// The orders of a placement: what the scheduling pass sends each node of a gang it placed (one
// TaskAssignment per node, one TrainerTask per rank there), and the reason stored with the
// placement ("attempt 2 placed on n1, n2, resuming from the checkpoint of step 400"). Pure
// functions of the job, the spec and plan it starts with and the gang scheduler's placement; the
// master port is filled in at admission, under the cluster lock, where ports are reserved.
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

// JobSpec.hang_timeout_seconds when 0: a collective blocked this long on a peer fails.
inline constexpr int kDefaultHangTimeoutSeconds = 300;

// The task id of `job_id`'s attempt `attempt` on `node`: "<job_id>/<attempt>/<node>".
std::string TaskId(const std::string& job_id, int32_t attempt, const std::string& node);

// The step `job`'s next attempt resumes from: its newest checkpoint's, unless `spec` turns
// resuming off (0: from the start).
int64_t StartStep(const v1::Job& job, const v1::JobSpec& spec);

// By node id, each node's assignment of `placement`: task id, and per rank its TrainerTask
// (`spec` as given, so the caller adds what every rank must share, e.g. the data rollbacks
// skipped; `plan`; the checkpoint directory, `checkpoint_root`/<job_id> unless the spec names
// one; the collective timeout; rank, world, local rank and world, master and node addresses,
// device). The master port is left 0.
std::map<std::string, v1::TaskAssignment> PlacementAssignments(const v1::Job& job,
                                                               const v1::JobSpec& spec,
                                                               const GangPlacement& placement,
                                                               const v1::LayoutPlan& plan,
                                                               const std::string& checkpoint_root);

// The reason stored with a placement: the nodes in rank order, and for a later attempt the step
// it resumes from and, when it got fewer devices than the job asked for, the plan it runs.
std::string PlacementReason(const v1::Job& job, const v1::JobSpec& spec,
                            const GangPlacement& placement, const v1::LayoutPlan& plan);

}  // namespace tessera::coordinator
