// The store and announce stages of the scheduling pass. A pass's writes (PassWrites: its
// placements first, then its changed pending reasons and its preemptions) are stored in ONE
// store transaction (one fsync), without the cluster lock; then, under it, each placement stored
// is announced (its held orders released to its nodes: NodeRegistry::ReleaseStart) and each one
// that could not be stored (its job cancelled meanwhile, or a store error) is taken back: its
// orders withdrawn (none was delivered) and its allocation erased, for a later pass to decide.
// Each stored placement's scheduling latency and queue wait go to the observers.
//
// Under the cluster's loop this runs on the pass's store thread (HandOffThread), beside the next
// pass; an allocation still being stored (Allocation::storing) is left alone by that pass.
//
// Thread safety: Store must be called without the cluster lock, by one thread at a time (the
// pass's, or its store thread); the observers may be set from any thread.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/guarded_ledger.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/scheduler/scheduler.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator {

// The store writes of one pass: its placements (the first `placements` writes, each owning what
// it writes), then its changed pending reasons and its victims' moves.
struct PassWrites {
  std::vector<JobManager::TransitionRequest> writes;
  size_t placements = 0;
};

// The write that stores a placement: SCHEDULED with its reason, plan, ranks and master port.
JobManager::TransitionRequest PlacementWrite(const v1::Job& job, const v1::JobSpec& spec,
                                             const GangPlacement& placement, v1::LayoutPlan plan,
                                             int master_port);

class StoreStage {
 public:
  // `state`, `ledger` and `jobs` must outlive the stage.
  StoreStage(ClusterState* state, GuardedLedger* ledger, JobManager* jobs)
      : state_(state), ledger_(ledger), jobs_(jobs) {}

  // Stores `pass` and announces or takes back its placements; returns the ids of the jobs placed.
  std::set<std::string> Store(PassWrites pass) ABSL_LOCKS_EXCLUDED(observers_mu_);

  // Seconds from submission to SCHEDULED of each job placed at its first attempt.
  void SetSchedulingLatencyObserver(std::function<void(double)> observer)
      ABSL_LOCKS_EXCLUDED(observers_mu_);
  // For each job placed, its queue (Job.queue as it counts, queue_config.h CountingQueue) and the
  // seconds it waited there: since its submission for attempt 0, since its previous attempt ended
  // for a later one.
  void SetQueueWaitObserver(std::function<void(const std::string& queue, double seconds)> observer)
      ABSL_LOCKS_EXCLUDED(observers_mu_);

 private:
  ClusterState* const state_;
  GuardedLedger* const ledger_;
  JobManager* const jobs_;
  absl::Mutex observers_mu_;
  std::function<void(double)> latency_observer_ ABSL_GUARDED_BY(observers_mu_);
  std::function<void(const std::string&, double)> queue_wait_observer_
      ABSL_GUARDED_BY(observers_mu_);
};

}  // namespace tessera::coordinator
