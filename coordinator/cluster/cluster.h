// Cluster: the coordinator's control loop over its workers, composed of its parts over the node
// registry (membership and liveness, its own lock), the allocation ledger (the live attempts,
// behind the cluster lock: guarded_ledger.h) and the ClusterState they share (options, store,
// each node's orders):
// WorkerProtocol answers workers (registrations, heartbeats, reports), AttemptFate decides what
// becomes of attempts that failed, moved or succeeded, and SchedulingPass runs a pass (Tick):
// liveness, the attempts' ends, the devices of ended attempts freed, one gang scheduling pass over
// the PENDING and RESTARTING jobs, its placements stored and announced. Cluster itself reloads
// the state at startup, serves the node views and the operator's node actions, and runs the loop
// that paces the passes (Start).
//
// Restarts: a failed attempt with restarts left goes RESTARTING; its tasks are stopped everywhere
// and the next attempt is placed only once every node of the failed one reported its task ended
// (or was lost), so no rank of attempt N runs beside attempt N+1. An automatic layout that no
// longer fits (a node is gone) is planned again for the devices that are free. Trainers resume
// from the newest complete checkpoint themselves.
//
// Thread safety: all methods may be called from any thread. The cluster lock guards the ledger
// and is held only as a GuardedLedger::Hold (guarded_ledger.h); the registry guards itself (taken
// after mu where both are); each is held only for short phases and never across a store write: what
// is decided under them (a job to RUNNING, SUCCEEDED, RESTARTING or FAILED, a placement, a node
// record) is stored after they are released, and an attempt whose end is being stored keeps its
// devices until the write is stored. A scheduling pass plans and schedules without it (see
// scheduling_pass.h), so heartbeats are not held up by a pass on a large cluster.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/daemon/call_executor.h"
#include "coordinator/cluster/allocation_ledger.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/cluster/queue_status.h"
#include "coordinator/cluster/scheduling_pass.h"
#include "coordinator/cluster/worker_protocol.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/store/store.h"
#include "tessera/v1/coordinator_service.pb.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

class Cluster {
 public:
  Cluster(Store* store, JobManager* jobs, ClusterOptions options);
  ~Cluster();

  // Reloads nodes from the store (each gets a fresh heartbeat grace period)
  // and the allocations of SCHEDULED / RUNNING jobs, so running work
  // reconciles when its workers next heartbeat. A RESTARTING job is placed
  // again by the scheduler; tasks of its old attempt still running anywhere
  // are stopped when their workers report them.
  absl::Status Recover();

  absl::StatusOr<v1::RegisterNodeResponse> Register(const v1::RegisterNodeRequest& request);
  // Never waits for a scheduling pass: a placement's assignments are queued for its nodes only
  // once the placement is stored.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::StatusOr<v1::ReportResponse> Report(const v1::ReportRequest& request);
  // Whether `node_id` may watch for its assignments: registered, and `node_key` is its key.
  absl::Status CheckWatcher(const std::string& node_id, const std::string& node_key);

  // Nodes with their free GPUs / slots and jobs; LOST ones when include_lost.
  std::vector<v1::Node> Nodes(bool include_lost);
  // The topology levels nodes are placed in (ClusterOptions::topology_levels).
  const std::vector<TopologyLevel>& topology_levels() const {
    return state_.options.topology_levels;
  }

  // Operator actions (Coordinator.DrainNode, UndrainNode, RemoveNode). A drained node gets no
  // new placements. With `checkpoint`, each running attempt with ranks on it is asked to save a
  // checkpoint and stop on all its nodes; once they all ended, its job is queued again (resuming
  // from that checkpoint) without a failure or restart counted. NOT_FOUND for an unknown node.
  absl::StatusOr<v1::DrainNodeResponse> DrainNode(const std::string& node_id, bool checkpoint,
                                                  const std::string& reason);
  absl::StatusOr<v1::Node> UndrainNode(const std::string& node_id);
  // FAILED_PRECONDITION unless the node is LOST or drained, and no attempt holds devices on it.
  absl::Status RemoveNode(const std::string& node_id);
  // What every registered node offers now (for planning).
  std::vector<NodeCapacity> Capacity();

  // One pass: liveness, settling, scheduling. Returns the pass's statistics. Without `count` (the
  // loop's early passes, asked for by RequestPass) it skips the scans of every node, liveness and
  // the cluster-wide node, device and ended-job counts, which the regular passes keep current;
  // its statistics then hold only the active job counts and the lock holds.
  // Tick stores its placements before it returns; the loop of Start() stores them beside the next
  // pass.
  ClusterStats Tick(bool count = true);
  // Runs Tick() every tick_interval on a thread until Stop(); `observer` (may
  // be null) gets each pass's statistics and duration.
  void Start(std::function<void(const ClusterStats&, double seconds)> observer);
  // Asks the loop for a pass soon (no sooner than min_tick_gap after the previous one started):
  // a job just submitted need not wait for the regular one. Requests made before that pass
  // starts are served by it. Never blocks on a pass.
  void RequestPass();
  // Stops the loop (after the pass in progress and its store writes) and saves the queues'
  // fair-share usage. Also run by the destructor; calling it again is harmless.
  void Stop();

  // `notifier` (may be null; must outlive the cluster) hears of each node that has new orders
  // (tasks to start or stop), so that its worker heartbeats at once. Orders queued while the
  // node's own heartbeat is handled go out in that heartbeat's response and are not announced.
  void SetAssignmentNotifier(AssignmentNotifier* notifier);

  // `executor` (may be null; must outlive the cluster's calls) runs the store writes a heartbeat
  // decides (a job to RUNNING or SUCCEEDED) after the heartbeat returns, so that a heartbeat
  // does not wait for the commits it decides. Null: the heartbeat makes them before it returns
  // (tests).
  void SetFollowUpExecutor(CallExecutor* executor);

  // Seconds from submission to SCHEDULED of each job placed, for metrics.
  void SetSchedulingLatencyObserver(std::function<void(double)> observer);
  // Seconds each placed job waited in its queue (SchedulingPass::SetQueueWaitObserver).
  void SetQueueWaitObserver(std::function<void(const std::string& queue, double seconds)> observer);

  // Coordinator.ListQueues: the queues in force with the latest pass's figures (queue_status.h).
  v1::ListQueuesResponse ListQueues();

  // The straggler figures of `job_id`'s running attempt, if any rank reported step times.
  std::optional<v1::StragglerReport> Straggler(const std::string& job_id);

 private:
  // One node's view for the node actions: free devices and the jobs on it.
  v1::Node NodeView(const v1::Node& node);
  // DrainNode's moves: with `checkpoint`, each attempt running as placed on `node_id` is asked to
  // save a checkpoint and stop (kMoving); the others are listed as remaining.
  void DrainLockedMoves(GuardedLedger::Hold& held, const std::string& node_id, bool checkpoint,
                        v1::DrainNodeResponse* response);
  // After each pass: each queue's running jobs into stats->queues (without a queue file, the
  // implicit queue's devices and jobs), kept for ListQueues.
  void RecordQueues(ClusterStats* stats) ABSL_LOCKS_EXCLUDED(queues_mu_);

  ClusterState state_;
  // The live attempts behind the cluster lock.
  GuardedLedger ledger_;
  // Declared after state_: it tells state_.orders which nodes are known and lost.
  NodeRegistry nodes_;
  AttemptFate fate_;
  WorkerProtocol protocol_;
  SchedulingPass pass_;

  std::thread loop_;
  absl::Mutex wake_mu_;
  bool pass_requested_ ABSL_GUARDED_BY(wake_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(wake_mu_) = false;

  // The latest pass's queue figures (RecordQueues). Never taken with the ledger held.
  absl::Mutex queues_mu_;
  std::map<std::string, ClusterStats::QueueFigures> queue_figures_ ABSL_GUARDED_BY(queues_mu_);
};

}  // namespace tessera::coordinator
