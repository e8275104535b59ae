// WorkerProtocol: the coordinator's side of what workers say: registrations (a worker that comes
// back without a task it was given has lost it), heartbeats (task states in, queued orders out),
// trainer reports relayed by workers (metrics, evals, checkpoints, failures, "every rank
// joined"), and the key check of a node that watches for its orders. Task states move the
// attempts on (AttemptFate takes the failures); the store writes they call for (a job to RUNNING
// or SUCCEEDED, node records) are decided under the cluster lock and made after it is released.
//
// Thread safety: every public method may be called from any thread; each asks the node registry
// (its own lock) about the calling node, then holds the cluster lock (a Hold of the ledger,
// guarded_ledger.h) for short holds, and never writes to the store while holding either. An attempt
// whose success is being recorded keeps its devices until the write is stored
// (Allocation::success_pending).
#pragma once

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/daemon/call_executor.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/nodes/node_registry.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

class WorkerProtocol {
 public:
  // `state`, `ledger`, `nodes`, `jobs` and `fate` must outlive the protocol.
  WorkerProtocol(ClusterState* state, GuardedLedger* ledger, NodeRegistry* nodes, JobManager* jobs,
                 AttemptFate* fate)
      : state_(state), ledger_(ledger), nodes_(nodes), jobs_(jobs), fate_(fate) {}

  absl::StatusOr<v1::RegisterNodeResponse> Register(const v1::RegisterNodeRequest& request);
  // Never waits for a scheduling pass nor for a store write.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::StatusOr<v1::ReportResponse> Report(const v1::ReportRequest& request);
  // Whether `node_id` may watch for its assignments: registered, and `node_key` is its key.
  absl::Status CheckWatcher(const std::string& node_id, const std::string& node_key);

  // See Cluster::SetFollowUpExecutor.
  void SetFollowUpExecutor(CallExecutor* executor) { follow_up_executor_ = executor; }

 private:
  // Store writes a heartbeat or registration decided under the lock, made once it is released.
  struct FollowUps {
    struct Running {
      std::string job_id;
      int32_t attempt = 0;
      int ranks = 0;
    };
    std::vector<Running> running;
    std::vector<std::pair<std::string, AttemptFate::SuccessRecord>> succeeded;
    bool empty() const { return running.empty() && succeeded.empty(); }
  };
  // Register's part under the lock, once the node is recorded: the attempts whose task the
  // worker no longer runs failed, the tasks it runs taken in.
  void RegisterLocked(GuardedLedger::Hold& held, const v1::RegisterNodeRequest& request,
                      FollowUps* follow_ups);
  void OnTaskStatusLocked(GuardedLedger::Hold& held, const std::string& node_id,
                          const v1::TaskStatus& status, FollowUps* follow_ups);
  // Moves jobs to RUNNING and SUCCEEDED as decided; a write that fails is tried again by the next
  // heartbeat (RUNNING) or pass (SUCCEEDED: the attempt keeps its devices until it is stored).
  void FinishFollowUps(const FollowUps& follow_ups);

  ClusterState* const state_;
  GuardedLedger* const ledger_;
  NodeRegistry* const nodes_;
  JobManager* const jobs_;
  AttemptFate* const fate_;
  std::atomic<CallExecutor*> follow_up_executor_{nullptr};
};

}  // namespace tessera::coordinator
