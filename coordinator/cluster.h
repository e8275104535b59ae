// Cluster: the coordinator's control loop over its workers. It ties together the node registry
// (NodeRegistry: registration, heartbeats, liveness, queued orders), the allocation ledger
// (AllocationLedger: devices held per job attempt and what each attempt reported), the gang
// scheduler and the job lifecycle (JobManager): each Tick() expires silent nodes, decides the fate
// of attempts that failed (blame, restart or fail, see attempt_policy.h), frees the devices of
// attempts whose every task has ended, retries store writes that failed, and runs one gang
// scheduling pass over the PENDING and RESTARTING jobs.
//
// Restarts: a failed attempt with restarts left goes RESTARTING; its tasks are stopped everywhere
// and the next attempt is placed only once every node of the failed one reported its task ended
// (or was lost), so no rank of attempt N runs beside attempt N+1. An automatic layout that no
// longer fits (a node is gone) is planned again for the devices that are free. Trainers resume
// from the newest complete checkpoint themselves.
//
// Thread safety: all methods may be called from any thread; one absl::Mutex (mu_) guards the
// registry and the ledger. JobManager and Store calls made under it never call back into Cluster.
// Heartbeats and registrations decide under mu_ and make the store writes that follow (a job to
// RUNNING or SUCCEEDED) after releasing it, so one heartbeat's fsync does not hold up the others;
// an attempt whose success is being recorded keeps its devices until the write is stored.
// A Tick holds mu_ only for short phases, so heartbeats are not held up by a scheduling pass on a
// large cluster: liveness and settling; a snapshot of the free devices (the registry's shared
// capacity summaries and the devices held, O(allocated ranks)); then, with mu_ released, planning
// and the gang scheduler; then the admission under mu_ of the placements whose nodes did not
// change since the snapshot (only a Tick adds or frees allocations, and passes are serialized by
// pass_mu_, so devices free in the snapshot are still free unless the node registered again):
// allocation made, assignments queued held back. The pass's placements and changed pending
// reasons are then stored in ONE store transaction with mu_ released; an assignment reaches a
// worker only once its placement is stored (a placement that cannot be stored is taken back), and
// no heartbeat waits for that store. Under Start() that transaction runs on a store thread beside
// the next pass (which waits only if it reaches its own store before the previous one finished);
// an allocation still being stored is left alone by passes (Allocation::storing). pass_mu_ also
// guards the plan cache.
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
#include "coordinator/allocation_ledger.h"
#include "coordinator/assignment_notifier.h"
#include "coordinator/job_manager.h"
#include "coordinator/node_registry.h"
#include "coordinator/scheduler.h"
#include "coordinator/store.h"
#include "planner/job_plan.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

struct ClusterOptions {
  // Heartbeat period asked of workers.
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // A node silent this long is LOST and its jobs' attempts fail.
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  // Period of Tick() when Start() runs the loop.
  absl::Duration tick_interval = absl::Milliseconds(200);
  // A pass asked for by RequestPass() (a job was submitted) starts this long after the previous
  // pass started at the soonest, so a stream of submissions does not run passes back to back.
  absl::Duration min_tick_gap = absl::Milliseconds(25);
  // After an attempt's first failure, how long to wait for more before blaming one: the whole
  // wait when only consequences (FAILURE_KIND_PEER_FAILED) came in, else blame_grace. The wait
  // ends early once every node of the attempt reported its task ended.
  absl::Duration failure_settle = absl::Seconds(5);
  absl::Duration blame_grace = absl::Seconds(1);
  // A rank whose busy time per step exceeds the median's by this factor is a straggler.
  double straggler_threshold = 1.2;
  // Checkpoint root for jobs whose spec names no directory: <root>/<job_id>. Made absolute by
  // the daemon at startup: trainers of each attempt run in a directory of their own.
  std::string checkpoint_root = "tessera-checkpoints";
  // First TCPStore port handed to a job's rank 0; each concurrent job whose
  // rank 0 is on the same node gets the next one.
  int base_master_port = 29500;
  // The clock; tests drive it.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

// Counters for metrics, computed by Tick().
struct ClusterStats {
  std::map<v1::NodeState, int64_t> nodes;
  std::map<v1::JobState, int64_t> jobs;
  int64_t gpus_total = 0, gpus_allocated = 0;
  int64_t cpu_slots_total = 0, cpu_slots_allocated = 0;
  // Restarts decided since the coordinator started, by the blamed failure's kind.
  std::map<v1::FailureKind, int64_t> restarts;
  // Jobs that ended FAILED since the coordinator started, by the blamed failure's kind.
  std::map<v1::FailureKind, int64_t> failures;
  // Age of the oldest PENDING job; 0 when none waits.
  double oldest_pending_seconds = 0;
  // Running jobs' straggler figures, by job_id.
  std::map<std::string, v1::StragglerReport> stragglers;
  // How long the pass held the cluster lock in all (heartbeats wait on it), and its longest
  // single hold; the planning and the gang scheduler run without it.
  double lock_held_seconds = 0;
  double longest_lock_hold_seconds = 0;
  // Where the pass's time went, by phase: "list" (reading the active and waiting jobs from the
  // store), "settle" (liveness, decisions and the capacity snapshot, under the cluster lock),
  // "plan" (each waiting job's plan and request), "schedule" (the gang scheduler), "admit"
  // (committing the placements under the lock), "store" (storing them and the pending reasons),
  // "count" (the cluster-wide figures). Wall time, waits included. Under Start(), "store" is the
  // wait to hand the placements to the store thread (the previous pass's store still running),
  // and "store_overlapped" the store thread's time for the previous pass's placements, spent
  // beside this pass and not part of its wall time.
  std::map<std::string, double> phase_seconds;
  // False for a pass that skipped the node, device, ended-job and straggler figures (Tick's
  // `count`): keep the previous ones.
  bool counted = true;
};

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

  // The straggler figures of `job_id`'s running attempt, if any rank reported step times.
  std::optional<v1::StragglerReport> Straggler(const std::string& job_id);

 private:
  static std::string TaskId(const std::string& job_id, int32_t attempt, const std::string& node);
  std::vector<NodeCapacity> CapacityLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a failure of the job's current attempt; the attempt enters kFailing.
  void AddFailureLocked(const std::string& job_id, int32_t attempt,
                        const v1::TrainerFailure& failure) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blames one failure of a kFailing attempt once the settle rules allow, and moves the job to
  // RESTARTING or FAILED; on a store error the attempt stays kFailing and the next tick retries.
  void DecideLocked(const std::string& job_id, Allocation& allocation, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops every task of the allocation that has not ended (a start not yet delivered is simply
  // withdrawn); the allocation is erased by Tick once all have ended.
  void DrainLocked(const std::string& job_id, Allocation& allocation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job of an attempt about to end (a decided failure, a move), read from the store; nullopt
  // when the read failed (logged; the next tick retries) or the job was cancelled meanwhile (the
  // attempt is drained).
  std::optional<v1::Job> JobToEndLocked(const std::string& job_id, Allocation& allocation,
                                        const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A kMoving attempt whose every node has ended: its job back to the queue (RESTARTING, the
  // attempt recorded, no restart counted) and the attempt drained. A store error leaves it
  // kMoving for the next tick.
  void SettleMoveLocked(const std::string& job_id, Allocation& allocation, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One node's view for ListNodes and the node actions: free devices and the jobs on it.
  v1::Node NodeViewLocked(const v1::Node& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireNodesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `job`'s plan for `target`, computed again only when the target (or the device count, for a
  // job re-planned after losing devices) changed.
  const absl::StatusOr<v1::LayoutPlan>& CachedPlan(
      const v1::Job& job, const v1::JobSpec& spec,
      const absl::StatusOr<planner::DeviceTarget>& target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_);
  // What a scheduling pass starts from, taken under mu_.
  struct PassSnapshot {
    // Jobs PENDING or RESTARTING without an allocation.
    std::set<std::string> waiting;
    std::shared_ptr<const std::vector<NodeCapacity>> summaries;
    UsedResources used;
    uint64_t generation = 0;
  };
  // `waiting`: the PENDING and RESTARTING jobs (Store::ListWaitingJobs).
  PassSnapshot SnapshotLocked(const std::vector<v1::Job>& waiting)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The store writes of one pass: its placements (the first `placements` writes, each owning
  // what it writes) and its changed pending reasons.
  struct PassWrites {
    std::vector<JobManager::TransitionRequest> writes;
    size_t placements = 0;
  };
  // One scheduling pass over the jobs waiting for devices (`active`: the PENDING and RESTARTING
  // jobs), computed without mu_: admits its placements (ids added to `admitted`) and returns the
  // writes that store them.
  PassWrites SchedulePass(const std::vector<v1::Job>& active, const PassSnapshot& snapshot,
                          ClusterStats* stats, std::set<std::string>* admitted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Stores a pass's writes in one transaction; then, under mu_, releases the assignments of each
  // placement stored and takes back each one that was not. Returns the ids of the jobs placed.
  std::set<std::string> StorePass(PassWrites pass) ABSL_LOCKS_EXCLUDED(mu_);
  // Tick's body; `overlap_store`: hand the writes to the store thread instead of storing them.
  ClusterStats RunPass(bool count, bool overlap_store) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives `pass` to the store thread once the previous pass's writes are stored.
  void HandOver(PassWrites pass) ABSL_LOCKS_EXCLUDED(store_mu_);
  void StoreLoop() ABSL_LOCKS_EXCLUDED(store_mu_);
  static int64_t StartStep(const v1::Job& job, const v1::JobSpec& spec);
  // The reason stored with a placement ("placed on n1, n2").
  static std::string PlacementReason(const v1::Job& job, const v1::JobSpec& spec,
                                     const GangPlacement& placement, const v1::LayoutPlan& plan);
  // Records the allocation of a placement and queues its assignments, held back from the nodes
  // until the placement is stored (NodeRegistry::ReleaseStart); returns its master port (stored
  // with the placement, so that a restarted coordinator reserves the same one).
  // `assignments` (from Assignments) get the master port chosen here.
  int AdmitLocked(const v1::Job& job, const v1::JobSpec& spec, const GangPlacement& placement,
                  std::map<std::string, v1::TaskAssignment> assignments)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A placement's assignment for each of its nodes, by node id, without the master port (made
  // without mu_: the spec and plan are copied for every node).
  std::map<std::string, v1::TaskAssignment> Assignments(const v1::Job& job, const v1::JobSpec& spec,
                                                        const GangPlacement& placement,
                                                        const v1::LayoutPlan& plan) const;
  // What RecordSuccess writes of an attempt.
  struct SuccessRecord {
    int32_t attempt = 0;
    std::vector<std::string> nodes;
    int world_size = 0;
    int64_t start_step = 0;
    absl::Time placed_time;
  };
  // Store writes a heartbeat or registration decided under mu_, made once it is released.
  struct FollowUps {
    struct Running {
      std::string job_id;
      int32_t attempt = 0;
      int ranks = 0;
    };
    std::vector<Running> running;
    std::vector<std::pair<std::string, SuccessRecord>> succeeded;
  };
  void OnTaskStatusLocked(const std::string& node_id, const v1::TaskStatus& status,
                          FollowUps* follow_ups) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves jobs to RUNNING and SUCCEEDED as decided; a write that fails is tried again by the next
  // heartbeat (RUNNING) or tick (SUCCEEDED: the attempt keeps its devices until it is stored).
  void FinishFollowUps(const FollowUps& follow_ups) ABSL_LOCKS_EXCLUDED(mu_);
  static SuccessRecord SuccessOf(const Allocation& allocation);
  // Moves a job whose every task succeeded to SUCCEEDED; false (retried later) on a store error.
  // Makes no use of mu_.
  bool RecordSuccess(const std::string& job_id, const SuccessRecord& success);

  Store* store_;
  JobManager* jobs_;
  const ClusterOptions options_;
  std::atomic<CallExecutor*> follow_up_executor_{nullptr};

  // Serializes Tick: one pass at a time. Taken before mu_.
  absl::Mutex pass_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  NodeRegistry nodes_ ABSL_GUARDED_BY(mu_);
  AllocationLedger allocations_ ABSL_GUARDED_BY(mu_);
  // Waiting jobs' plans (PlanForTarget), keyed by job_id, with the target they were made for.
  struct PlanEntry {
    std::string fingerprint;
    std::optional<absl::StatusOr<v1::LayoutPlan>> plan;
  };
  std::map<std::string, PlanEntry> plan_cache_ ABSL_GUARDED_BY(pass_mu_);
  std::function<void(double)> latency_observer_ ABSL_GUARDED_BY(mu_);
  AssignmentNotifier* notifier_ ABSL_GUARDED_BY(mu_) = nullptr;
  // The node whose heartbeat is being handled: its new orders leave with the response.
  std::string heartbeat_node_ ABSL_GUARDED_BY(mu_);
  std::map<v1::FailureKind, int64_t> restarts_ ABSL_GUARDED_BY(mu_);
  std::map<v1::FailureKind, int64_t> failures_ ABSL_GUARDED_BY(mu_);

  std::thread loop_;
  absl::Mutex wake_mu_;
  absl::CondVar wake_cv_;
  bool pass_requested_ ABSL_GUARDED_BY(wake_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(wake_mu_) = false;

  // The store thread (started by Start): one pass's writes in flight, the next waits its turn.
  std::thread store_loop_;
  absl::Mutex store_mu_;
  std::optional<PassWrites> store_next_ ABSL_GUARDED_BY(store_mu_);
  bool store_busy_ ABSL_GUARDED_BY(store_mu_) = false;
  bool store_stopping_ ABSL_GUARDED_BY(store_mu_) = false;
  // The store thread's seconds not yet reported in a pass's statistics.
  double store_overlapped_seconds_ ABSL_GUARDED_BY(store_mu_) = 0;
};

}  // namespace tessera::coordinator
