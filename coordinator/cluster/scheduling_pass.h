// SchedulingPass: one pass of the coordinator's control loop, as a pipeline: list the active and
// waiting jobs (store reads); settle (under the cluster lock: node liveness, the attempts whose
// end is due, the devices of ended attempts freed); store the ends decided (AttemptFate, lock
// released) and the node records changed; snapshot the free devices; plan each waiting job for
// the devices it would get (the planning stage, scheduling/plan_stage.h: plans cached per job
// until their target changes) and run the gang scheduler, both without the lock; admit the
// placements (under the lock: allocations made, assignments queued held back); store the
// placements and the pending reasons worth a write (scheduling/pending_reasons.h) in ONE store
// transaction (lock released); announce each stored placement to its nodes (its held assignments
// released) and take back each one that could not be stored. With the store thread started, that
// transaction runs beside the next pass, which waits only if it reaches its own store before the
// previous one finished; an allocation still being stored is left alone (Allocation::storing).
// Finally the pass's statistics. The stages in coordinator/scheduling/ read only their inputs
// and their own memory; the rest of the pass still works on the shared ClusterState.
//
// Only a pass adds or frees allocations and passes are serialized, so devices free in the
// snapshot are still free at admission unless their node registered again (or was lost), which
// NodeRegistry::ChangedSince tells: that gang waits for the next pass.
//
// Thread safety: Run may be called from any thread; passes are serialized by pass_mu_ (taken
// before the cluster lock ClusterState::mu), which also guards the stages' memory between passes.
// The cluster lock is held only for short phases and never across a store write. The store
// thread (HandOffThread) guards its hand-over itself.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/fair_share_saver.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/queues/fair_share.h"
#include "coordinator/queues/queue_admission.h"
#include "coordinator/queues/queue_preemption.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/scheduling/assignments.h"
#include "coordinator/scheduling/hand_off_thread.h"
#include "coordinator/scheduling/pending_reasons.h"
#include "coordinator/scheduling/plan_stage.h"
#include "coordinator/scheduling/queue_stage.h"
#include "planner/job_plan.h"

namespace tessera::coordinator {

class SchedulingPass {
 public:
  // `state`, `jobs` and `fate` must outlive the pass.
  SchedulingPass(ClusterState* state, JobManager* jobs, AttemptFate* fate)
      : state_(state), jobs_(jobs), fate_(fate), fair_share_saver_(state->store) {}
  // Stops the store thread (after storing what it was handed).
  ~SchedulingPass();
  SchedulingPass(const SchedulingPass&) = delete;
  SchedulingPass& operator=(const SchedulingPass&) = delete;

  // One pass (see Cluster::Tick for `count`). With `overlap_store`, its placements are handed to
  // the store thread (StartStoreThread first) instead of being stored before it returns.
  ClusterStats Run(bool count, bool overlap_store) ABSL_LOCKS_EXCLUDED(pass_mu_, state_->mu);

  // The thread that stores the placements of passes run with `overlap_store`. Stop stores what
  // was handed over before it returns.
  void StartStoreThread();
  void StopStoreThread();

  // Saves the queues' fair-share usage now (fair_share_saver.h), as the coordinator stops;
  // nothing before the first pass with queues. A pass saves it every kSaveInterval on its own.
  void SaveFairShare() ABSL_LOCKS_EXCLUDED(pass_mu_);

  // Seconds from submission to SCHEDULED of each job placed, for metrics. Called without locks.
  void SetSchedulingLatencyObserver(std::function<void(double)> observer)
      ABSL_LOCKS_EXCLUDED(state_->mu);
  // For each job placed, its queue (Job.queue as it counts, queue_config.h CountingQueue) and the
  // seconds it waited there: since its submission for attempt 0, since its previous attempt
  // ended for a later one. Called without locks.
  void SetQueueWaitObserver(std::function<void(const std::string& queue, double seconds)> observer)
      ABSL_LOCKS_EXCLUDED(state_->mu);

 private:
  // What the scheduling part of a pass starts from, taken under the cluster lock.
  struct Snapshot {
    // Jobs PENDING or RESTARTING without an allocation.
    std::set<std::string> waiting;
    std::shared_ptr<const std::vector<NodeCapacity>> summaries;
    UsedResources used;
    uint64_t generation = 0;
    // The queues in force for this pass, and the devices each queue's allocations hold
    // (filled only when queues are configured).
    std::shared_ptr<const QueueConfig> queues;
    std::map<std::string, Resources> queue_use;
  };
  // The store writes of one pass: its placements (the first `placements` writes, each owning
  // what it writes) and its changed pending reasons.
  struct Writes {
    std::vector<JobManager::TransitionRequest> writes;
    size_t placements = 0;
  };

  // `waiting`: the PENDING and RESTARTING jobs (Store::ListWaitingJobs).
  // `queues`: the configuration for this pass (QueueFile::Current, read before the lock).
  Snapshot SnapshotLocked(const std::vector<v1::Job>& waiting,
                          std::shared_ptr<const QueueConfig> queues)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Each configured queue's figures for the pass's statistics (ClusterStats::queues).
  void CountQueues(const QueueConfig& config, const Snapshot& snapshot,
                   const std::vector<v1::Job>& waiting, ClusterStats* stats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_);
  // Preemption (queue_preemption.h), under the lock: for the first job its quota holds back
  // (by priority, then age) that preemption would let start, the victims are asked to save a
  // checkpoint and stop (AttemptFate::MoveLocked) and queued again once stopped, no restart
  // counted; the job's reason says what it waits for. One decision per pass, none while an
  // earlier preemption is still stopping its victims. Each victim's move to PREEMPTED is added
  // to `writes` (stored with the pass, only while the job still runs that attempt).
  void PreemptLocked(const Snapshot& snapshot, std::vector<QueuedRequest> held_requests,
                     std::map<std::string, std::string>* reasons,
                     std::vector<JobManager::TransitionRequest>* writes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_, state_->mu);
  // Priority preemption when the cluster is full (capacity_preemption.h), under the lock, after
  // PreemptLocked decided nothing: for the first of `unplaced` (by priority, then age; one per
  // queue and resource) whose queue holds lower-priority jobs whose devices would let its gang
  // start, those are asked to save a checkpoint and stop, as PreemptLocked's victims are.
  // `queues`: each unplaced job's Job.queue. With or without a queue file.
  void PreemptForCapacityLocked(const Snapshot& snapshot, const std::vector<GangRequest>& unplaced,
                                const std::map<std::string, std::string>& queues,
                                std::map<std::string, std::string>* reasons,
                                std::vector<JobManager::TransitionRequest>* writes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_, state_->mu);
  // Asks `decision`'s victims to save a checkpoint and stop within `deadline`, for `for_job`
  // (`label`: " of queue nlp"); their moves to PREEMPTED go to `writes`, `for_job`'s reason to
  // `reasons`. `config`: the queues in force (null without a queue file), for the metrics.
  void PreemptVictimsLocked(const std::string& for_job, const std::string& label,
                            const PreemptionDecision& decision, absl::Duration deadline,
                            const QueueConfig* config, std::map<std::string, std::string>* reasons,
                            std::vector<JobManager::TransitionRequest>* writes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_, state_->mu);
  // Plans, schedules and admits the waiting jobs (`waiting`, from ListWaitingJobs) without the
  // lock but for the admission; returns the writes that store the placements (ids added to
  // `admitted`) and the changed pending reasons.
  Writes PlanAndAdmit(const std::vector<v1::Job>& waiting, const Snapshot& snapshot,
                      ClusterStats* stats, std::set<std::string>* admitted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_) ABSL_LOCKS_EXCLUDED(state_->mu);
  // Stores a pass's writes in one transaction; then, under the lock, releases the assignments of
  // each placement stored and takes back each one that was not. Returns the ids of the jobs placed.
  std::set<std::string> StoreWrites(Writes pass) ABSL_LOCKS_EXCLUDED(state_->mu);
  // Gives `pass` to the store thread once the previous pass's writes are stored.
  // Settling, under the lock: liveness (when `count`), the attempts of jobs no longer active
  // (`active_ids`; null when the listing failed) drained, and the attempts whose end is due.
  std::vector<AttemptFate::Ending> SettleLocked(
      bool count, absl::Time now, const absl::flat_hash_set<std::string_view>* active_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Under the lock, once the ends are stored: applies them, and frees the devices of the attempts
  // whose every task has ended. Returns whether one of them belongs to a job still active (it
  // restarts: the waiting jobs are listed again, so that it can be placed in this pass).
  bool FreeEndedLocked(const std::vector<AttemptFate::Ending>& endings,
                       const absl::flat_hash_set<std::string_view>* active_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // The cluster-wide figures of a counted pass.
  void CountLocked(ClusterStats* stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  // Names each GPU rank's device (RankPlacement.gpu_uuid, gpu_name) from its node's inventory.
  void IdentifyGpusLocked(std::vector<v1::RankPlacement>& ranks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);
  // Records the allocation of a placement and queues its assignments, held back from the nodes
  // until the placement is stored (NodeRegistry::ReleaseStart); returns its master port (stored
  // with the placement, so that a restarted coordinator reserves the same one).
  // `assignments` (from Assignments) get the master port chosen here.
  int AdmitLocked(const v1::Job& job, const v1::JobSpec& spec, const GangPlacement& placement,
                  std::map<std::string, v1::TaskAssignment> assignments)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu);

  ClusterState* const state_;
  JobManager* const jobs_;
  AttemptFate* const fate_;

  // Serializes Run: one pass at a time. Taken before the cluster lock.
  absl::Mutex pass_mu_;
  // The planning stage (scheduling/plan_stage.h), with its plans cached between passes.
  PlanStage plan_stage_ ABSL_GUARDED_BY(pass_mu_);
  // Which pending reasons a pass stores (scheduling/pending_reasons.h).
  PendingReasons pending_reasons_ ABSL_GUARDED_BY(pass_mu_);
  // Quota admission and the queues' fair share (scheduling/queue_stage.h), from the first pass
  // with queues configured.
  QueueStage queue_stage_ ABSL_GUARDED_BY(pass_mu_);
  // Restores the queue stage's fair-share usage from the store when it is created and saves it
  // now and then.
  FairShareSaver fair_share_saver_ ABSL_GUARDED_BY(pass_mu_);
  // Jobs preempted since start, by victim queue, then reason (PreemptionKindName).
  std::map<std::string, std::map<std::string, int64_t>> preemptions_ ABSL_GUARDED_BY(pass_mu_);
  std::function<void(double)> latency_observer_ ABSL_GUARDED_BY(state_->mu);
  std::function<void(const std::string&, double)> queue_wait_observer_ ABSL_GUARDED_BY(state_->mu);

  // The store thread (scheduling/hand_off_thread.h): one pass's writes in flight, the next
  // waits its turn; its busy seconds are the next pass's "store_overlapped".
  HandOffThread<Writes> store_thread_{[this](Writes pass) { StoreWrites(std::move(pass)); },
                                      "pass-store"};
};

}  // namespace tessera::coordinator
