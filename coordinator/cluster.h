// Cluster: the coordinator's view of its workers and what runs on them. It
// keeps the node registry (registration, heartbeats, liveness), the
// allocation of GPUs and CPU slots to jobs, and the queues of work handed out
// in heartbeat responses; each Tick() expires silent nodes, runs one gang
// scheduling pass over the PENDING jobs, and settles jobs whose tasks ended.
//
// Thread safety: all methods may be called from any thread; one absl::Mutex
// guards the registry, allocations and queues. JobManager and Store calls
// made under it never call back into Cluster.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/job_manager.h"
#include "coordinator/scheduler.h"
#include "coordinator/store.h"
#include "planner/job_plan.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

struct ClusterOptions {
  // Heartbeat period asked of workers.
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // A node silent this long is LOST and its jobs fail.
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  // Period of Tick() when Start() runs the loop.
  absl::Duration tick_interval = absl::Milliseconds(200);
  // Checkpoint root for jobs whose spec names no directory: <root>/<job_id>.
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
};

class Cluster {
 public:
  Cluster(Store* store, JobManager* jobs, ClusterOptions options);
  ~Cluster();

  // Reloads nodes from the store (each gets a fresh heartbeat grace period)
  // and the allocations of SCHEDULED / RUNNING jobs, so running work
  // reconciles when its workers next heartbeat.
  absl::Status Recover();

  absl::StatusOr<v1::RegisterNodeResponse> Register(const v1::RegisterNodeRequest& request);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  absl::StatusOr<v1::ReportResponse> Report(const v1::ReportRequest& request);

  // Nodes with their free GPUs / slots and jobs; LOST ones when include_lost.
  std::vector<v1::Node> Nodes(bool include_lost);
  // What every registered node offers now (for planning).
  std::vector<NodeCapacity> Capacity();

  // One pass: liveness, settling, scheduling. Returns the pass's statistics.
  ClusterStats Tick();
  // Runs Tick() every tick_interval on a thread until Stop(); `observer` (may
  // be null) gets each pass's statistics and duration.
  void Start(std::function<void(const ClusterStats&, double seconds)> observer);
  void Stop();

  // Seconds from submission to SCHEDULED of each job placed, for metrics.
  void SetSchedulingLatencyObserver(std::function<void(double)> observer);

 private:
  struct NodeEntry {
    v1::Node node;
    absl::Time last_heartbeat;
    std::vector<v1::TaskAssignment> to_start;
    std::vector<std::string> to_stop;
  };
  struct Allocation {
    int32_t attempt = 0;
    std::vector<v1::RankPlacement> ranks;
    std::string master_node;
    int master_port = 0;
    // node_id -> last task state reported.
    std::map<std::string, v1::TaskState> task_states;
    // Every node has reported its tasks RUNNING once and the job's state was brought to RUNNING
    // (or found past SCHEDULED): later heartbeats need not read the job again.
    bool running_seen = false;
  };

  static std::string TaskId(const std::string& job_id, int32_t attempt, const std::string& node);
  std::vector<NodeCapacity> CapacityLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int MasterPortLocked(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues stop orders for every task of `job_id` and frees its resources.
  void ReleaseLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailJobLocked(const std::string& job_id, const v1::TrainerFailure& failure,
                     const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireNodesLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `job`'s plan for `target`, computed again only when the target changed.
  const absl::StatusOr<v1::LayoutPlan>& CachedPlanLocked(
      const v1::Job& job, const absl::StatusOr<planner::DeviceTarget>& target)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One scheduling pass over the active jobs; returns the ids of the jobs it placed.
  std::set<std::string> ScheduleLocked(const std::vector<v1::Job>& active)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PlaceLocked(const v1::Job& job, const GangPlacement& placement, const v1::LayoutPlan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnTaskStatusLocked(const std::string& node_id, const v1::TaskStatus& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Store* store_;
  JobManager* jobs_;
  const ClusterOptions options_;

  absl::Mutex mu_;
  std::map<std::string, NodeEntry> nodes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Allocation> allocations_ ABSL_GUARDED_BY(mu_);
  // Pending jobs' plans (PlanForTarget), keyed by job_id, with the target they were made for.
  struct CachedPlan {
    std::string fingerprint;
    std::optional<absl::StatusOr<v1::LayoutPlan>> plan;
  };
  std::map<std::string, CachedPlan> plan_cache_ ABSL_GUARDED_BY(mu_);
  std::function<void(double)> latency_observer_ ABSL_GUARDED_BY(mu_);

  std::thread loop_;
  absl::Notification stop_;
};

}  // namespace tessera::coordinator
