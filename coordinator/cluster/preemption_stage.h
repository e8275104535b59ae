// The preemption stage of the scheduling pass, under the cluster lock after the reservation:
// first the quota preemption of queue_preemption.h (for the first job its quota holds back, by
// priority then age, that preemption would let start), and when that decides nothing the
// priority preemption on a full cluster of capacity_preemption.h (for the first job the
// scheduler could not place whose queue holds lower-priority jobs whose devices would let its
// gang start). Either way the victims are asked to save a checkpoint and stop
// (AttemptFate::MoveLocked) and are queued again once stopped, no restart counted; the job's
// pending reason says what it waits for; each victim's move to PREEMPTED is a write stored with
// the pass (only while the job still runs that attempt). One decision per pass, none while an
// earlier preemption is still stopping its victims; only each queue's head (per resource) may
// preempt, so a pass makes at most one search per queue and resource.
//
// Thread safety: RunLocked needs the cluster lock, which is the fate's too; the counts are the
// stage's own, and its owner (the pass) serializes every call.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/time/time.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/cluster/pass_snapshot.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/queues/queue_admission.h"
#include "coordinator/queues/queue_preemption.h"
#include "coordinator/scheduler/scheduler.h"

namespace tessera::coordinator {

class PreemptionStage {
 public:
  // `nodes` and `fate` must outlive the stage.
  PreemptionStage(const NodeRegistry* nodes, AttemptFate* fate) : nodes_(nodes), fate_(fate) {}

  // `held_by_quota`: the requests the queues' quotas held back (QueueStage::Admit);
  // `unplaced`: the requests the scheduler tried and could not place, and `queue_of` each one's
  // Job.queue. Adds the victims' moves to `writes` and the preempting job's reason to `reasons`.
  void RunLocked(GuardedLedger::Hold& held, ClusterState& state, const PassSnapshot& snapshot,
                 std::vector<QueuedRequest> held_by_quota, const std::vector<GangRequest>& unplaced,
                 const std::map<std::string, std::string>& queue_of,
                 std::map<std::string, std::string>* reasons,
                 std::vector<JobManager::TransitionRequest>* writes);

  // Jobs preempted since the coordinator started, by the victim's queue, then reason
  // (PreemptionKindName).
  const std::map<std::string, std::map<std::string, int64_t>>& counts() const {
    return preemptions_;
  }

 private:
  void QuotaLocked(GuardedLedger::Hold& held, ClusterState& state, const PassSnapshot& snapshot,
                   std::vector<QueuedRequest> held_requests,
                   std::map<std::string, std::string>* reasons,
                   std::vector<JobManager::TransitionRequest>* writes);
  void CapacityLocked(GuardedLedger::Hold& held, ClusterState& state, const PassSnapshot& snapshot,
                      const std::vector<GangRequest>& unplaced,
                      const std::map<std::string, std::string>& queues,
                      std::map<std::string, std::string>* reasons,
                      std::vector<JobManager::TransitionRequest>* writes);
  // Asks `decision`'s victims to save a checkpoint and stop within `deadline`, for `for_job`
  // (`label`: " of queue nlp"). `config`: the queues in force (null without a queue file), for
  // the counts.
  void VictimsLocked(GuardedLedger::Hold& held, ClusterState& state, const std::string& for_job,
                     const std::string& label, const PreemptionDecision& decision,
                     absl::Duration deadline, const QueueConfig* config,
                     std::map<std::string, std::string>* reasons,
                     std::vector<JobManager::TransitionRequest>* writes);

  const NodeRegistry* const nodes_;
  AttemptFate* const fate_;
  std::map<std::string, std::map<std::string, int64_t>> preemptions_;
};

}  // namespace tessera::coordinator
