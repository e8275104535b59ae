// The counting stage of the scheduling pass: the figures of ClusterStats that a counted pass
// takes (nodes by state, devices, restarts and failures, stragglers, under the cluster lock) and
// each configured queue's (quota, use, borrowing, fair share, preemptions, waiting jobs, from
// the pass's snapshot, without it).
//
// Thread safety: CountClusterLocked needs the cluster lock, which is the fate's too;
// CountQueues reads only its arguments.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/cluster/pass_snapshot.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/queues/queue_config.h"
#include "coordinator/scheduling/queue_stage.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

void CountClusterLocked(GuardedLedger::Hold& held, ClusterState& state, const NodeRegistry& nodes,
                        AttemptFate& fate, ClusterStats* stats);

// `waiting`: the pass's waiting jobs (those of `snapshot.waiting` count); `preemptions`:
// PreemptionStage::counts().
void CountQueues(const QueueConfig& config, const PassSnapshot& snapshot,
                 const std::vector<v1::Job>& waiting, const QueueStage& queue_stage,
                 const std::map<std::string, std::map<std::string, int64_t>>& preemptions,
                 ClusterStats* stats);

}  // namespace tessera::coordinator
