#include "coordinator/cluster/scheduling_pass.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "coordinator/cluster/pass_counts.h"
#include "coordinator/cluster/pass_timing.h"
#include "coordinator/cluster/reservation_stage.h"
#include "coordinator/cluster/settle_stage.h"

namespace tessera::coordinator {

PassWrites SchedulingPass::Place(const std::vector<v1::Job>& active, const PassSnapshot& snapshot,
                                 ClusterStats* stats) {
  if (snapshot.queues != nullptr) {
    // What each queue held since the previous pass counts towards its fair share, on top of
    // what it used before a restart (restored once). Saved here, with the cluster lock released.
    const absl::Time now = state_->Now();
    FairShareTracker& tracker = queue_stage_.Tracker(*snapshot.queues, now);
    fair_share_saver_.RestoreInto(&tracker);
    queue_stage_.Accrue(now, snapshot.queue_use);
    fair_share_saver_.MaybeSave(now, tracker);
    CountQueues(*snapshot.queues, snapshot, active, queue_stage_, preemption_stage_.counts(),
                stats);
  }
  pending_reasons_.Keep(snapshot.waiting);
  if (snapshot.waiting.empty()) {
    plan_stage_.Clear();
    return {};
  }
  PhaseTimer phase(stats);
  NodeRegistry::SubtractInto(*snapshot.summaries, snapshot.used, &capacity_);
  PlannedJobs planned = plan_stage_.Run(active, snapshot.waiting, capacity_);
  const PlacedJobs jobs{planned.jobs, planned.specs, planned.plans};
  // Only what the queues' quotas admit tries placement.
  QueueStage::Held quota_held;
  if (snapshot.queues != nullptr) {
    quota_held =
        queue_stage_.Admit(*snapshot.queues, snapshot.queue_use, planned.jobs, &planned.requests);
  }
  phase.Next("plan");
  // What the scheduler cannot place may preempt lower priorities of its queue.
  std::vector<GangRequest> unplaced = planned.requests;
  std::map<std::string, std::string> queue_of;
  for (const GangRequest& request : unplaced) {
    queue_of[request.job_id] = planned.jobs.at(request.job_id)->queue();
  }
  ScheduleResult result;
  if (!planned.requests.empty()) {
    result = Schedule(std::move(planned.requests), capacity_);
  }
  std::set<std::string> placed_ids;
  for (const GangPlacement& placement : result.placed) placed_ids.insert(placement.job_id);
  std::erase_if(unplaced, [&](const GangRequest& r) { return placed_ids.contains(r.job_id); });
  result.pending_reasons.merge(quota_held.reasons);
  phase.Next("schedule");
  std::vector<std::map<std::string, v1::TaskAssignment>> assignments =
      MakeAssignments(*state_, result.placed, jobs);
  Reservation reservation;
  std::vector<JobManager::TransitionRequest> preempted;  // the victims' moves to PREEMPTED
  {
    GuardedLedger::Hold held(ledger_, &stats->lock_held_seconds, &stats->longest_lock_hold_seconds);
    reservation = ReserveLocked(held, *state_, *nodes_, result.placed, snapshot.generation, jobs,
                                std::move(assignments));
    preemption_stage_.RunLocked(held, *state_, snapshot, std::move(quota_held.requests), unplaced,
                                queue_of, &result.pending_reasons, &preempted);
  }
  phase.Next("admit");
  // Each write owns what it stores: under Start() it is stored beside the next pass.
  PassWrites pass;
  for (const GangPlacement* placement : reservation.placements) {
    const std::string& job_id = placement->job_id;
    pass.writes.push_back(PlacementWrite(*planned.jobs.at(job_id), planned.specs.at(job_id),
                                         *placement, std::move(planned.plans[job_id]),
                                         reservation.master_ports.at(job_id)));
  }
  pass.placements = pass.writes.size();
  result.pending_reasons.merge(planned.unfit);
  for (auto& [job_id, reason] :
       pending_reasons_.ToWrite(result.pending_reasons, active, state_->Now())) {
    pass.writes.push_back(
        {std::move(job_id), v1::JOB_STATE_PENDING, std::move(reason), nullptr, nullptr});
  }
  for (auto& write : preempted) pass.writes.push_back(std::move(write));
  phase.Next("store");
  return pass;
}

ClusterStats SchedulingPass::Run(bool count, bool overlap_store) {
  absl::MutexLock pass_lock(&pass_mu_);
  const absl::Time now = state_->Now();
  // Read (and re-read when the file changed) before any lock is taken.
  std::shared_ptr<const QueueConfig> queues =
      state_->options.queues != nullptr ? state_->options.queues->Current() : nullptr;
  ClusterStats stats;
  stats.counted = count;
  PhaseTimer phase(&stats);
  // Read without the lock. Only the waiting jobs are parsed: parsing every running job's blob
  // cost more than the rest of a pass on a busy cluster. Allocations are added only by a pass, so
  // every allocation's job is listed unless it ended since; a job cancelled or finished meanwhile
  // is seen by the next pass.
  absl::StatusOr<std::vector<Store::JobSummary>> active = state_->store->ListActiveJobSummaries();
  absl::StatusOr<std::vector<v1::Job>> waiting = state_->store->ListWaitingJobs();
  // Looked up once per allocation under the lock: built before taking it.
  absl::flat_hash_set<std::string_view> active_ids;
  if (active.ok()) {
    active_ids.reserve(active->size());
    for (const auto& job : *active) active_ids.insert(job.job_id);
  }
  phase.Next("list");
  std::vector<AttemptFate::Ending> endings;
  {
    GuardedLedger::Hold held(ledger_, &stats.lock_held_seconds, &stats.longest_lock_hold_seconds);
    endings = SettleLocked(held, *fate_, count, now, active.ok() ? &active_ids : nullptr);
  }
  // The node records changed (registrations, nodes lost; a write that failed before) and the
  // attempts' ends are stored with the lock released: heartbeats go on meanwhile. An ending
  // attempt keeps its devices until then.
  LogRetried(nodes_->Flush(), "writing node records");
  fate_->StoreEndings(endings, now);
  PassSnapshot snapshot;
  bool relist = false;
  {
    GuardedLedger::Hold held(ledger_, &stats.lock_held_seconds, &stats.longest_lock_hold_seconds);
    relist = FreeEndedLocked(held, *fate_, endings, active.ok() ? &active_ids : nullptr);
    if (active.ok() && !relist && waiting.ok()) {
      snapshot = TakePassSnapshotLocked(held, *state_, *nodes_, *waiting, queues);
    }
  }
  phase.Next("settle");
  if (relist) {
    active_ids.clear();  // views into the listing replaced here
    active = state_->store->ListActiveJobSummaries();
    waiting = state_->store->ListWaitingJobs();
    phase.Next("list");
    if (waiting.ok()) {
      GuardedLedger::Hold held(ledger_, &stats.lock_held_seconds, &stats.longest_lock_hold_seconds);
      snapshot = TakePassSnapshotLocked(held, *state_, *nodes_, *waiting, queues);
    }
    phase.Next("settle");
  }
  if (active.ok() && waiting.ok()) {
    std::set<std::string> placed;
    PassWrites pass = Place(*waiting, snapshot, &stats);
    phase = PhaseTimer(&stats);
    if (overlap_store) {
      // Counted as placed: the store thread takes a placement back only if its job was cancelled
      // meanwhile (or on a store error), which the next pass's counts show.
      for (size_t i = 0; i < pass.placements; ++i) placed.insert(pass.writes[i].job_id);
      if (!pass.writes.empty()) store_thread_.HandOver(std::move(pass));
    } else {
      placed = store_stage_.Store(std::move(pass));
    }
    phase.Next("store");
    if (const double overlapped = store_thread_.TakeBusySeconds(); overlapped > 0) {
      stats.phase_seconds["store_overlapped"] += overlapped;
    }
    for (const auto& job : *active) {
      const bool pending = !placed.contains(job.job_id) && job.state == v1::JOB_STATE_PENDING;
      ++stats.jobs[placed.contains(job.job_id) ? v1::JOB_STATE_SCHEDULED : job.state];
      if (pending) {
        stats.oldest_pending_seconds =
            std::max(stats.oldest_pending_seconds,
                     absl::ToDoubleSeconds(now - absl::FromUnixNanos(job.create_time_ns)));
      }
    }
  } else {
    LogRetried(active.ok() ? waiting.status() : active.status(), "listing active jobs");
  }
  if (!count) return stats;
  const std::vector<TopologyLevel>& levels = state_->options.topology_levels;
  UsedResources used;
  {
    GuardedLedger::Hold held(ledger_, &stats.lock_held_seconds, &stats.longest_lock_hold_seconds);
    CountClusterLocked(held, *state_, *nodes_, *fate_, &stats);
    if (!levels.empty()) used = held->Used();
  }
  // The topology's figures walk every node: without the cluster lock.
  if (!levels.empty()) stats.topology = BuildTopology(levels, nodes_->TopologyNodes(used)).levels;
  // Ended jobs are counted by the store (the active ones above, as this pass left them).
  if (auto ended = state_->store->CountEndedJobs(); ended.ok()) {
    for (const auto& [state, count] : *ended) stats.jobs[state] = count;
  } else {
    LogRetried(ended.status(), "counting ended jobs");
  }
  phase.Next("count");
  return stats;
}

void SchedulingPass::StartStoreThread() { store_thread_.Start(); }

void SchedulingPass::StopStoreThread() { store_thread_.Stop(); }

SchedulingPass::~SchedulingPass() { StopStoreThread(); }

void SchedulingPass::SaveFairShare() {
  absl::MutexLock lock(&pass_mu_);
  if (const FairShareTracker* tracker = queue_stage_.tracker(); tracker != nullptr) {
    fair_share_saver_.Save(*tracker);
  }
}

}  // namespace tessera::coordinator
