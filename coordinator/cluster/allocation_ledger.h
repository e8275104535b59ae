// AllocationLedger: which job attempt holds which devices, and how far each attempt has got. An
// allocation is made when a gang is placed and lives until every node of the attempt has reported
// its task ended (or was lost): while a failed or cancelled attempt drains, its devices stay held,
// so no rank of attempt N shares a device with attempt N+1 or another job. Along the way it
// gathers what the attempt's nodes report: task states, failures (all of them, for blame), the
// report sequence acknowledged per node (so a resent batch is stored once) and each rank's latest
// step time.
//
// Not thread-safe: GuardedLedger holds it behind the cluster lock (guarded_ledger.h).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "coordinator/nodes/node_registry.h"
#include "coordinator/queues/queue_config.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

struct Allocation {
  enum class Phase {
    // Ranks starting or training.
    kRunning,
    // A failure came in; more may follow before one is blamed (see AttemptFate::PrepareLocked).
    kFailing,
    // The attempt is over (decided, succeeded or cancelled); waiting for every node to stop.
    kDraining,
    // Asked to save a checkpoint and stop, to be placed again elsewhere (a node of it was drained
    // with checkpoint): once every node has ended, the job goes back to the queue without a
    // failure or a restart counted (AttemptFate, Ending::Kind::kMove). Failures are recorded, not
    // decided.
    kMoving,
  };

  int32_t attempt = 0;
  // The job's queue (Job.queue), whose quota the ranks' devices count against, and its
  // priority (JobSpec.priority), which preemption weighs.
  std::string queue;
  int priority = 0;
  std::vector<v1::RankPlacement> ranks;
  std::string master_node;
  int master_port = 0;
  absl::Time placed_time;
  // Optimizer step the attempt resumes from: where it was placed to, then where its rank 0
  // reported it did (TrainerStarted.start_step).
  int64_t start_step = 0;
  // When the attempt's newest checkpoint was committed (its create_time as reported, never later
  // than when the report came in); placed_time until it reports one (after a coordinator restart:
  // the job's newest checkpoint's). A stop loses the progress since then: preemption takes the
  // victims that lose least.
  absl::Time last_checkpoint_time;
  // Where the attempt is (see Phase). Moved on by AttemptFate only: a part that sees an attempt
  // fail, succeed or stop tells the fate, which decides.
  Phase phase() const { return phase_; }
  // Every failure reported for the attempt, in arrival order; first_failure_time is when the
  // first came in.
  std::vector<v1::TrainerFailure> failures;
  absl::Time first_failure_time;
  // node_id -> highest report sequence stored.
  std::map<std::string, int64_t> acked_sequence;
  // rank -> its latest step time.
  std::map<int, v1::RankStepTime> rank_times;
  // Every node reported its tasks RUNNING once and the job was brought to RUNNING (or found past
  // SCHEDULED): later heartbeats need not read the job again.
  bool running_seen = false;
  // Admitted by a scheduling pass whose store transaction has not finished: the job may still
  // read PENDING in the store and its assignments are held back. A pass leaves it alone (no
  // drain, no decision) until the store thread releases or takes it back.
  bool storing = false;
  // Every node reported SUCCEEDED and a heartbeat is storing the job's success outside the
  // cluster lock: nobody else records it, and the devices stay held until it is stored.
  bool success_pending = false;
  // kMoving: the drained node the attempt moves off, for the job's history.
  std::string moving_off;
  // kMoving by preemption: why ("preempted by job-... of queue nlp (...)"), for its history;
  // when the ranks were asked to save a checkpoint, and how long they were given.
  std::string preempted;
  absl::Time preempted_time;
  absl::Duration preemption_deadline;
  // Rank 0's report of a loss spike of this attempt (TrainerReport.loss_spike), for its ending,
  // which records it in the Rollback event (AttemptFate::AddLossSpikeLocked). Kept in memory
  // only: a coordinator restarted meanwhile records the spike's step and cause from the failure.
  std::optional<v1::LossSpike> spike;

  // The attempt's nodes, in order of their first rank.
  std::vector<std::string> Nodes() const;
  // What a node's task last reported (or was taken to be), and that a node was declared LOST (its
  // task counts as ended). Both keep the counts behind AllNodesIn and AllNodesEnded, which every
  // pass asks of every allocation: `ranks` must be complete before the first call.
  void SetTaskState(const std::string& node_id, v1::TaskState state);
  void MarkLost(const std::string& node_id);
  // Whether `node_id`'s task has ended (terminal state reported, or the node lost).
  bool NodeEnded(const std::string& node_id) const;
  // Whether every node of the attempt ended, or last reported `state`; O(1).
  bool AllNodesEnded() const;
  bool AllNodesIn(v1::TaskState state) const;
  // Adds a failure unless the same rank already reported one of the same kind and message.
  void AddFailure(const v1::TrainerFailure& failure, absl::Time now);

 private:
  friend class AttemptFate;
  void SetPhase(Phase phase) { phase_ = phase; }

  Phase phase_ = Phase::kRunning;
  bool HasNode(const std::string& node_id) const;
  int NodeCount() const;

  // node_id -> last task state reported.
  std::map<std::string, v1::TaskState> task_states_;
  // Nodes of the attempt declared LOST.
  std::set<std::string> lost_nodes_;
  // Of the attempt's nodes (a state of a node without a rank is kept, not counted): how many last
  // reported each state, and how many ended.
  std::array<int, v1::TaskState_ARRAYSIZE> nodes_in_state_{};
  int nodes_ended_ = 0;
  // The distinct nodes of `ranks`; -1 until first needed.
  mutable int node_count_ = -1;
};

class AllocationLedger {
 public:
  Allocation* Find(const std::string& job_id);
  // Replaces any allocation of `job_id`.
  Allocation& Add(const std::string& job_id, Allocation allocation);
  void Erase(const std::string& job_id);
  // Erases the allocations for which `pred(job_id, allocation)` holds; returns how many.
  size_t EraseIf(const std::function<bool(const std::string&, const Allocation&)>& pred);
  // For iteration and changes in place; allocations are added and erased only through the
  // methods above, and their ranks and queue are not changed (the index by node, the device
  // counts behind Used() and the queues' holds are kept from them).
  std::map<std::string, Allocation>& all() { return allocations_; }

  // Devices held by every allocation, draining ones included.
  UsedResources Used() const;
  // The lowest port from `base` not held by a rank 0 of another allocation on `node_id`, and not
  // `avoid` (a restarting job's previous port: whatever held it, maybe not one of ours, may
  // still).
  int FreeMasterPort(const std::string& node_id, int base, int avoid = 0) const;
  // Jobs with a rank on `node_id`, in job_id order; from an index, so a heartbeat does not scan
  // every allocation.
  std::vector<std::string> JobsOn(const std::string& node_id) const;

  // What the allocations of one queue hold, draining ones included.
  struct QueueHold {
    // Allocations counted (an entry is kept while this is > 0, even if they hold nothing).
    int64_t allocations = 0;
    Resources held;
  };
  // Allocation::queue as stored (the job's raw queue name, possibly empty) -> its hold, kept by
  // Add and Erase: a pass maps these to the queues in force (which a reloaded file may change)
  // in O(queues), without walking every allocation.
  const std::map<std::string, QueueHold>& HeldByQueue() const { return held_by_queue_; }

 private:
  void Unindex(const std::string& job_id, const Allocation& allocation);
  // Rewrites `node_id`'s entry of used_ from held_gpus_ and held_cpu_slots_ (adding it if new).
  void RefreshUsed(const std::string& node_id);

  std::map<std::string, Allocation> allocations_;
  // node_id -> jobs with a rank there. Hashed: every heartbeat looks its node up under the
  // cluster lock, and nothing walks it in order.
  absl::flat_hash_map<std::string, std::set<std::string>> jobs_by_node_;
  // node_id -> GPU index -> ranks holding it (more than one only if a placement was doubled), and
  // node_id -> CPU ranks: what Used reports, kept by Add and Unindex.
  absl::flat_hash_map<std::string, std::map<int, int>> held_gpus_;
  absl::flat_hash_map<std::string, int> held_cpu_slots_;
  // The same holdings as Used() returns them, kept as they change: ascending node_id, but with
  // entries of nodes that hold nothing now (a node's entry is made at its first rank and stays,
  // so that a placement rarely inserts into the vector; compacted once most are empty). A pass
  // copies it under the cluster lock: one pass over contiguous memory, not a walk of two trees.
  std::vector<UsedResources::Node> used_;
  size_t empty_used_ = 0;
  std::map<std::string, QueueHold> held_by_queue_;
};

}  // namespace tessera::coordinator
