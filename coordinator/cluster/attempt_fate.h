// AttemptFate: what becomes of a job attempt once it stops running as placed. It gathers an
// attempt's failures (reported by trainers, workers that restarted, nodes that went silent),
// decides, once the settle rules allow, which failure to blame and whether the job restarts or
// fails (attempt_policy.h), queues a moved attempt's job again, records successes, and drains an
// ended attempt (stops its tasks; its devices stay held until every task has ended).
//
// Deciding is split in three so that no store write is made under the cluster lock: under it,
// PrepareLocked picks the attempts whose end is due and copies what their record needs; without
// it, StoreEndings reads each job and stores its end (one transaction each); under it again,
// FinishLocked drains the attempts whose end was stored and leaves the others as they were, for
// the next pass to try again. An attempt keeps its devices until its end is stored.
//
// Thread safety: the *Locked methods need the cluster lock, which they take as a Hold of the
// ledger (guarded_ledger.h); the others must be called without it. Store is called by one
// scheduling pass at a time; RecordSuccess from any thread. The counters have a lock of their own
// (taken after the ledger's).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "coordinator/cluster/allocation_ledger.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/nodes/node_registry.h"

namespace tessera::coordinator {

class AttemptFate {
 public:
  // `state`, `nodes` and `jobs` must outlive the fate.
  AttemptFate(ClusterState* state, NodeRegistry* nodes, JobManager* jobs)
      : state_(state), nodes_(nodes), jobs_(jobs) {}

  // Records a failure of the job's current attempt (one of an earlier attempt is dropped); a
  // running attempt enters kFailing.
  void AddFailureLocked(GuardedLedger::Hold& held, const std::string& job_id, int32_t attempt,
                        const v1::TrainerFailure& failure);
  // Keeps rank 0's report of a loss spike of the job's current attempt (Allocation::spike) for
  // the attempt's ending, which records it in the Rollback event; one of an earlier attempt is
  // dropped.
  void AddLossSpikeLocked(GuardedLedger::Hold& held, const std::string& job_id, int32_t attempt,
                          const v1::LossSpike& spike);
  // Marks the nodes silent for longer than the heartbeat timeout LOST and fails the attempts
  // that had ranks there (their record writes are left to NodeRegistry::Flush).
  void ExpireNodesLocked(GuardedLedger::Hold& held, absl::Time now);
  // Stops every task of the allocation that has not ended (a start not yet delivered is simply
  // withdrawn); the allocation is erased by a pass once all have ended.
  void DrainLocked(GuardedLedger::Hold& held, const std::string& job_id, Allocation& allocation);
  // Asks every task of the allocation that has not ended to save a checkpoint and stop (a start
  // not yet delivered is withdrawn): the attempt moves (kMoving) and its job is queued again once
  // all have ended, no restart counted. A preempted allocation (`preempted` set) gives its ranks
  // its preemption_deadline; a drained one the workers' checkpoint grace.
  void MoveLocked(GuardedLedger::Hold& held, const std::string& job_id, Allocation& allocation);
  // A running attempt whose task stopped though nothing here asked it to: a move this coordinator
  // ordered before it restarted. It moves as it would have (kMoving), no order queued.
  void MovedLocked(GuardedLedger::Hold& held, Allocation& allocation);

  // An attempt whose end is to be stored, as PrepareLocked found it.
  struct Ending {
    enum class Kind {
      kFailure,  // a kFailing attempt: blame a failure, restart or fail the job
      kMove,     // a kMoving attempt whose every node ended: queue its job again
      kSuccess,  // every node succeeded and no heartbeat records it: record the success
    };
    Kind kind = Kind::kFailure;
    std::string job_id;
    Allocation attempt;  // a copy, taken under the lock
    // Set by Store: drain the attempt (its end is stored, or its job ended meanwhile), and the
    // kind of the failure counted as a restart (restart) or as a failed job (!restart).
    bool drain = false;
    std::optional<v1::FailureKind> counted;
    bool restart = false;
    // A kFailure's loss spike as rank 0 reported it (AddLossSpikeLocked), if it did.
    std::optional<v1::LossSpike> spike;
  };
  // Under the lock, for each allocation of an active job not being stored: a kMoving attempt
  // whose nodes all succeeded goes back to kRunning (a success); an attempt whose end is due is
  // added to `endings` (a success is marked success_pending meanwhile).
  void PrepareLocked(GuardedLedger::Hold& held, const std::string& job_id, Allocation& allocation,
                     absl::Time now, std::vector<Ending>* endings);
  // Without the lock: stores each ending (a store error is logged and left for the next pass).
  void StoreEndings(std::vector<Ending>& endings, absl::Time now);
  // Under the lock: applies what Store found to the allocations, if they are still there.
  void FinishLocked(GuardedLedger::Hold& held, const std::vector<Ending>& endings)
      ABSL_LOCKS_EXCLUDED(counts_mu_);

  // What RecordSuccess writes of an attempt.
  struct SuccessRecord {
    int32_t attempt = 0;
    std::vector<std::string> nodes;
    int world_size = 0;
    int64_t start_step = 0;
    absl::Time placed_time;
  };
  static SuccessRecord SuccessOf(const Allocation& allocation);
  // Moves a job whose every task succeeded to SUCCEEDED; false (retried later) on a store error.
  bool RecordSuccess(const std::string& job_id, const SuccessRecord& success);

  // Restarts decided and jobs failed since the coordinator started, by the blamed failure's kind.
  std::map<v1::FailureKind, int64_t> restarts() const ABSL_LOCKS_EXCLUDED(counts_mu_) {
    absl::MutexLock lock(&counts_mu_);
    return restarts_;
  }
  std::map<v1::FailureKind, int64_t> failures() const ABSL_LOCKS_EXCLUDED(counts_mu_) {
    absl::MutexLock lock(&counts_mu_);
    return failures_;
  }

 private:
  // Stops each task of the allocation that has not ended: a start not yet delivered is withdrawn,
  // a delivered one is ordered to stop (to save a checkpoint first with `checkpoint`).
  void StopTasksLocked(GuardedLedger::Hold& held, const std::string& job_id, Allocation& allocation,
                       bool checkpoint);
  // The job of an ending attempt, read from the store; nullopt when the read failed (logged; the
  // next pass retries) or the job ended meanwhile (`ending->drain` set).
  std::optional<v1::Job> JobToEnd(Ending* ending, const char* why);
  void StoreFailure(Ending* ending, absl::Time now);
  // StoreFailure's path for a guarded job's loss spike: a rollback (no restart counted) or, past
  // guard.max_rollbacks, the job's failure naming the spikes' steps.
  void StoreSpike(Ending* ending, const v1::Job& job, const v1::TrainerFailure& primary,
                  size_t blamed, absl::Time now);
  void StoreMove(Ending* ending, absl::Time now);
  // What StoreFailure and StoreSpike share: stores the attempt's record (the blamed failure and
  // the others as consequences, each also an event, then `extra_event` if set) and the job in
  // RESTARTING when `restart` (the attempt advanced, placements cleared, trained from
  // `resume_step`, then `on_restart` applied) or FAILED, with `reason`; `doing` names the change
  // in the log when the store fails.
  void StoreAttemptEnd(Ending* ending, const v1::Job& job, const v1::TrainerFailure& primary,
                       size_t blamed, absl::Time now, bool restart, const std::string& reason,
                       int64_t resume_step, const std::optional<v1::JobEvent>& extra_event,
                       absl::FunctionRef<void(v1::Job&)> on_restart, absl::string_view doing);

  ClusterState* const state_;
  NodeRegistry* const nodes_;
  JobManager* const jobs_;
  mutable absl::Mutex counts_mu_;
  std::map<v1::FailureKind, int64_t> restarts_ ABSL_GUARDED_BY(counts_mu_);
  std::map<v1::FailureKind, int64_t> failures_ ABSL_GUARDED_BY(counts_mu_);
};

}  // namespace tessera::coordinator
