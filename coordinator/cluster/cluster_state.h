// ClusterState: what the parts Cluster is made of share besides the owners they are handed (the
// node registry, the allocation ledger behind the cluster lock): the options and the statistics
// of the cluster, the store, and each node's orders (the order outbox, which keeps its own lock).
// The parts: WorkerProtocol (registrations, heartbeats, reports), AttemptFate (failures,
// decisions, moves, successes), SchedulingPass (the gang scheduling pass).
//
// Thread safety: immutable but for the outbox, which guards itself.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/nodes/order_outbox.h"
#include "coordinator/queues/queue_config.h"
#include "coordinator/queues/queue_file.h"
#include "coordinator/scheduler/topology.h"
#include "coordinator/scheduling/assignments.h"  // TaskId
#include "coordinator/store/store.h"
#include "google/protobuf/timestamp.pb.h"
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
  // The clock of liveness, settle times and the history's times (must outlive the cluster);
  // tests pass a SimulatedClock. The loop of Cluster::Start paces its passes on it too.
  Clock* clock = Clock::Real();
  // Queues and quotas (--queue_file); null: one implicit queue, no quotas. Must outlive the
  // cluster.
  QueueFile* queues = nullptr;
  // The cluster's topology levels, lowest first (--topology_levels); none by default.
  std::vector<TopologyLevel> topology_levels;
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
  // Each configured queue's quota, holdings and waiting jobs (empty without a queue file).
  struct QueueFigures {
    Resources nominal;
    Resources used;
    // Used beyond nominal.
    Resources borrowed;
    // Jobs holding devices: every allocation (SCHEDULED, RUNNING, PREEMPTED, and attempts whose
    // ranks are still stopping). Counted by Cluster after the pass from the ledger's per-queue
    // holds, so it includes the pass's placements, which used and waiting_jobs (counted before
    // them) show from the next pass on.
    int64_t running_jobs = 0;
    // PENDING or RESTARTING jobs waiting for devices.
    int64_t waiting_jobs = 0;
    // FairShareTracker::Share: decayed dominant-resource usage over weight.
    double fair_share = 0;
    // Its jobs preempted since the coordinator started, by reason ("reclaim", "priority").
    std::map<std::string, int64_t> preemptions;
  };
  std::map<std::string, QueueFigures> queues;
  // How long the pass held the cluster lock in all (heartbeats wait on it), and its longest
  // single hold; the planning and the gang scheduler run without it.
  double lock_held_seconds = 0;
  double longest_lock_hold_seconds = 0;
  // Where the pass's time went, by phase: "list" (reading the active and waiting jobs from the
  // store), "settle" (liveness, decisions and the capacity snapshot under the cluster lock, and
  // between those holds the node records and the attempts' ends stored without it),
  // "plan" (each waiting job's plan and request), "schedule" (the gang scheduler), "admit"
  // (committing the placements under the lock), "store" (storing them and the pending reasons),
  // "count" (the cluster-wide figures). Wall time, waits included. Under Start(), "store" is the
  // wait to hand the placements to the store thread (the previous pass's store still running),
  // and "store_overlapped" the store thread's time for the previous pass's placements, spent
  // beside this pass and not part of its wall time.
  std::map<std::string, double> phase_seconds;
  // Per topology level (ClusterOptions::topology_levels), lowest first: domains, the largest
  // free one, fragmentation (topology.h). Counted with the nodes.
  std::vector<TopologyLevelFigures> topology;
  // False for a pass that skipped the node, device, ended-job and straggler figures (Tick's
  // `count`): keep the previous ones.
  bool counted = true;
};

google::protobuf::Timestamp ToProto(absl::Time time);
absl::Time FromProto(const google::protobuf::Timestamp& time);
// A store write whose failure the next tick repairs: worth a log line, not a crash or a lost job.
void LogRetried(const absl::Status& status, const std::string& what);

struct ClusterState {
  // `store` must outlive the state.
  ClusterState(Store* store, ClusterOptions options);
  ClusterState(const ClusterState&) = delete;
  ClusterState& operator=(const ClusterState&) = delete;

  absl::Time Now() const { return options.clock->Now(); }

  Store* const store;
  const ClusterOptions options;

  // Each node's orders and their announcement; its own lock (taken after the ledger's and the
  // registry's where they are held).
  OrderOutbox orders;
};

}  // namespace tessera::coordinator
