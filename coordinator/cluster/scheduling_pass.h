// SchedulingPass: one pass of the coordinator's control loop, as a pipeline of stages, each in a
// file of its own:
//   list        the active and waiting jobs (store reads, no lock)
//   settle      liveness, the attempts whose end is due, their ends stored, the devices of ended
//               attempts freed (settle_stage.h, AttemptFate)
//   snapshot    the free devices and the waiting jobs, under the lock (pass_snapshot.h)
//   queues      fair share accrued and quota admission (scheduling/queue_stage.h)
//   plan        each waiting job planned for the devices it would get, plans cached per job
//               until their target changes (scheduling/plan_stage.h)
//   schedule    the gang scheduler (scheduler/scheduler.h)
//   reserve     the placements become allocations, their orders queued held back
//               (reservation_stage.h)
//   preempt     quota, then capacity preemption (preemption_stage.h)
//   store       placements, pending reasons worth a write (scheduling/pending_reasons.h) and
//               preemptions in one transaction; then announce: orders released, or the placement
//               taken back (store_stage.h)
//   count       the pass's figures (pass_counts.h)
// The lock is held only in settle, snapshot, reserve + preempt, announce and count; planning and
// the gang scheduler run without it, and no store write is made under it. With the store thread
// started, the store stage runs beside the next pass, which waits only if it reaches its own
// store before the previous one finished; an allocation still being stored is left alone
// (Allocation::storing).
//
// Only a pass adds or frees allocations and passes are serialized, so devices free in the
// snapshot are still free at reservation unless their node registered again (or was lost), which
// NodeRegistry::ChangedSince tells: that gang waits for the next pass.
//
// Thread safety: Run may be called from any thread; passes are serialized by pass_mu_ (taken
// before the cluster lock, the ledger's), which also guards the stages' memory between passes.
// The store thread (HandOffThread) guards its hand-over itself.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/fair_share_saver.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/cluster/pass_snapshot.h"
#include "coordinator/cluster/preemption_stage.h"
#include "coordinator/cluster/store_stage.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/scheduling/hand_off_thread.h"
#include "coordinator/scheduling/pending_reasons.h"
#include "coordinator/scheduling/plan_stage.h"
#include "coordinator/scheduling/queue_stage.h"

namespace tessera::coordinator {

class SchedulingPass {
 public:
  // `state`, `ledger`, `nodes`, `jobs` and `fate` must outlive the pass.
  SchedulingPass(ClusterState* state, GuardedLedger* ledger, NodeRegistry* nodes, JobManager* jobs,
                 AttemptFate* fate)
      : state_(state),
        ledger_(ledger),
        nodes_(nodes),
        fate_(fate),
        preemption_stage_(nodes, fate),
        store_stage_(state, ledger, jobs),
        fair_share_saver_(state->store) {}
  // Stops the store thread (after storing what it was handed).
  ~SchedulingPass();
  SchedulingPass(const SchedulingPass&) = delete;
  SchedulingPass& operator=(const SchedulingPass&) = delete;

  // One pass (see Cluster::Tick for `count`). With `overlap_store`, its writes are handed to the
  // store thread (StartStoreThread first) instead of being stored before it returns.
  ClusterStats Run(bool count, bool overlap_store) ABSL_LOCKS_EXCLUDED(pass_mu_);

  // The thread that stores the writes of passes run with `overlap_store`. Stop stores what was
  // handed over before it returns.
  void StartStoreThread();
  void StopStoreThread();

  // Saves the queues' fair-share usage now (fair_share_saver.h), as the coordinator stops;
  // nothing before the first pass with queues. A pass saves it every kSaveInterval on its own.
  void SaveFairShare() ABSL_LOCKS_EXCLUDED(pass_mu_);

  // StoreStage's observers (store_stage.h). Called without locks.
  void SetSchedulingLatencyObserver(std::function<void(double)> observer) {
    store_stage_.SetSchedulingLatencyObserver(std::move(observer));
  }
  void SetQueueWaitObserver(
      std::function<void(const std::string& queue, double seconds)> observer) {
    store_stage_.SetQueueWaitObserver(std::move(observer));
  }

 private:
  // Queues, plan, schedule, reserve, preempt for the waiting jobs (`waiting`, from
  // ListWaitingJobs); returns the writes that store the pass (placements and reasons).
  PassWrites Place(const std::vector<v1::Job>& waiting, const PassSnapshot& snapshot,
                   ClusterStats* stats) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pass_mu_);

  ClusterState* const state_;
  GuardedLedger* const ledger_;
  NodeRegistry* const nodes_;
  AttemptFate* const fate_;

  // Serializes Run: one pass at a time. Taken before the cluster lock.
  absl::Mutex pass_mu_;
  PlanStage plan_stage_ ABSL_GUARDED_BY(pass_mu_);
  PendingReasons pending_reasons_ ABSL_GUARDED_BY(pass_mu_);
  // From the first pass with queues configured.
  QueueStage queue_stage_ ABSL_GUARDED_BY(pass_mu_);
  PreemptionStage preemption_stage_ ABSL_GUARDED_BY(pass_mu_);
  // The free capacity of the pass in progress; kept between passes so that filling it reuses its
  // elements' storage (NodeRegistry::SubtractInto).
  std::vector<NodeCapacity> capacity_ ABSL_GUARDED_BY(pass_mu_);
  StoreStage store_stage_;
  // Restores the queue stage's fair-share usage from the store when it is created and saves it
  // now and then.
  FairShareSaver fair_share_saver_ ABSL_GUARDED_BY(pass_mu_);

  // The store thread (scheduling/hand_off_thread.h): one pass's writes in flight, the next
  // waits its turn; its busy seconds are the next pass's "store_overlapped".
  HandOffThread<PassWrites> store_thread_{
      [this](PassWrites pass) { store_stage_.Store(std::move(pass)); }, "pass-store"};
};

}  // namespace tessera::coordinator
