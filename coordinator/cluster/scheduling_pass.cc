#include "coordinator/cluster/scheduling_pass.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "coordinator/jobs/attempt_policy.h"
#include "coordinator/nodes/shard_cache_peers.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

// Holds a mutex for one phase of a pass and adds the time held to the pass's statistics.
class ABSL_SCOPED_LOCKABLE TimedLock {
 public:
  TimedLock(absl::Mutex* mu, ClusterStats* stats) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu)
      : lock_(mu), stats_(stats), start_(std::chrono::steady_clock::now()) {}
  ~TimedLock() ABSL_UNLOCK_FUNCTION() {
    const double held =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    stats_->lock_held_seconds += held;
    stats_->longest_lock_hold_seconds = std::max(stats_->longest_lock_hold_seconds, held);
  }

 private:
  absl::MutexLock lock_;
  ClusterStats* stats_;
  std::chrono::steady_clock::time_point start_;
};

// Adds the wall time from its construction (or the previous Next) to stats->phase_seconds[phase].
class PhaseTimer {
 public:
  explicit PhaseTimer(ClusterStats* stats)
      : stats_(stats), start_(std::chrono::steady_clock::now()) {}
  void Next(const char* phase) {
    const auto now = std::chrono::steady_clock::now();
    stats_->phase_seconds[phase] += std::chrono::duration<double>(now - start_).count();
    start_ = now;
  }

 private:
  ClusterStats* stats_;
  std::chrono::steady_clock::time_point start_;
};

// A restart's trainers learn how far the store's step metrics are complete, so that rank 0
// reports again, from the checkpoint it resumes from, the steps whose reports were lost with the
// previous attempt (TrainerTask.metrics_complete_through_step). One read of the job's metric
// steps, without the cluster lock; on an error (logged) the field stays unset and nothing is
// reported again.
void StampMetricsComplete(Store& store, const v1::Job& job,
                          std::map<std::string, v1::TaskAssignment>& assignments) {
  if (job.attempt() == 0) return;
  absl::StatusOr<int64_t> complete = store.MetricsCompleteThrough(job.job_id(), 0);
  if (!complete.ok()) {
    LogRetried(complete.status(), absl::StrCat("reading the metric steps of job ", job.job_id()));
    return;
  }
  for (auto& [node_id, assignment] : assignments) {
    for (v1::TrainerTask& task : *assignment.mutable_trainers()) {
      task.set_metrics_complete_through_step(*complete);
    }
  }
}

}  // namespace

void SchedulingPass::IdentifyGpusLocked(std::vector<v1::RankPlacement>& ranks) {
  for (v1::RankPlacement& rank : ranks) {
    if (rank.gpu_index() < 0) continue;
    const v1::Node* node = state_->nodes.Find(rank.node_id());
    if (node == nullptr) continue;
    for (const v1::GpuDevice& gpu : node->resources().gpus()) {
      if (gpu.index() != rank.gpu_index()) continue;
      rank.set_gpu_uuid(gpu.uuid());
      rank.set_gpu_name(gpu.name());
    }
  }
}

int SchedulingPass::AdmitLocked(const v1::Job& job, const v1::JobSpec& spec,
                                const GangPlacement& placement,
                                std::map<std::string, v1::TaskAssignment> assignments) {
  Allocation allocation;
  allocation.attempt = job.attempt();
  allocation.queue = job.queue();
  allocation.priority = spec.priority();
  allocation.ranks = placement.ranks;
  allocation.master_node = placement.ranks.front().node_id();
  allocation.master_port = state_->allocations.FreeMasterPort(
      allocation.master_node, state_->options.base_master_port, /*avoid=*/job.master_port());
  const int master_port = allocation.master_port;
  allocation.placed_time = state_->Now();
  allocation.last_checkpoint_time = allocation.placed_time;
  allocation.start_step = StartStep(job, spec);
  allocation.storing = true;
  std::map<std::string, std::string> worker_addresses;
  for (const auto& [node_id, assignment] : assignments) {
    if (const v1::Node* node = state_->nodes.Find(node_id); node != nullptr) {
      worker_addresses[node_id] = node->address();
    }
  }
  AssignShardCachePeers(worker_addresses, assignments);
  for (auto& [node_id, assignment] : assignments) {
    for (v1::TrainerTask& task : *assignment.mutable_trainers()) {
      task.mutable_assignment()->set_master_port(master_port);
    }
    state_->nodes.QueueStart(node_id, std::move(assignment), /*held=*/true);
  }
  state_->allocations.Add(job.job_id(), std::move(allocation));
  return master_port;
}

void SchedulingPass::CountQueues(const QueueConfig& config, const Snapshot& snapshot,
                                 const std::vector<v1::Job>& waiting, ClusterStats* stats) {
  for (const QueueSpec& queue : config.queues) {
    ClusterStats::QueueFigures& figures = stats->queues[queue.name];
    figures.nominal = queue.nominal;
    if (auto it = snapshot.queue_use.find(queue.name); it != snapshot.queue_use.end()) {
      figures.used = it->second;
    }
    figures.borrowed.gpus = std::max<int64_t>(0, figures.used.gpus - queue.nominal.gpus);
    figures.borrowed.cpu_slots =
        std::max<int64_t>(0, figures.used.cpu_slots - queue.nominal.cpu_slots);
    figures.fair_share = queue_stage_.Share(config, queue.name);
    if (auto it = preemptions_.find(queue.name); it != preemptions_.end()) {
      figures.preemptions = it->second;
    }
  }
  for (const v1::Job& job : waiting) {
    if (!snapshot.waiting.contains(job.job_id())) continue;
    auto it = stats->queues.find(CountingQueue(job.queue(), config));
    if (it != stats->queues.end()) ++it->second.waiting_jobs;
  }
}

SchedulingPass::Snapshot SchedulingPass::SnapshotLocked(const std::vector<v1::Job>& waiting,
                                                        std::shared_ptr<const QueueConfig> queues) {
  Snapshot snapshot;
  if (queues != nullptr && !queues->implicit()) {
    // Every allocation, draining ones included, holds its devices against its queue. The
    // ledger keeps the holds by the queue name the jobs were stored with; mapped here to the
    // queues in force, in O(queues) rather than O(allocations).
    for (const auto& [queue, hold] : state_->allocations.HeldByQueue()) {
      snapshot.queue_use[CountingQueue(queue, *queues)] += hold.held;
    }
    snapshot.queues = std::move(queues);
  }
  for (const auto& job : waiting) {
    // A restarting job is listed while its failed attempt still drains.
    if (state_->allocations.Find(job.job_id()) == nullptr) {
      snapshot.waiting.insert(job.job_id());
    }
  }
  if (snapshot.waiting.empty()) return snapshot;
  snapshot.summaries = state_->nodes.Summaries();
  snapshot.used = state_->allocations.Used();
  snapshot.generation = state_->nodes.generation();
  return snapshot;
}

SchedulingPass::Writes SchedulingPass::PlanAndAdmit(const std::vector<v1::Job>& active,
                                                    const Snapshot& snapshot, ClusterStats* stats,
                                                    std::set<std::string>* admitted_ids) {
  // `active` holds the waiting jobs (ListWaitingJobs).
  const std::set<std::string>& waiting_ids = snapshot.waiting;
  if (snapshot.queues != nullptr) {
    // What each queue held since the previous pass counts towards its fair share, on top of
    // what it used before a restart (restored once). Saved here, with the cluster lock released.
    const absl::Time now = state_->Now();
    FairShareTracker& tracker = queue_stage_.Tracker(*snapshot.queues, now);
    fair_share_saver_.RestoreInto(&tracker);
    queue_stage_.Accrue(now, snapshot.queue_use);
    fair_share_saver_.MaybeSave(now, tracker);
    CountQueues(*snapshot.queues, snapshot, active, stats);
  }
  pending_reasons_.Keep(waiting_ids);
  if (waiting_ids.empty()) {
    plan_stage_.Clear();
    return {};
  }
  PhaseTimer phase(stats);
  std::vector<NodeCapacity> capacity = NodeRegistry::Subtract(*snapshot.summaries, snapshot.used);
  PlannedJobs planned = plan_stage_.Run(active, waiting_ids, capacity);
  std::vector<GangRequest>& requests = planned.requests;
  const std::map<std::string, const v1::Job*>& waiting = planned.jobs;
  std::map<std::string, v1::JobSpec>& specs = planned.specs;
  std::map<std::string, v1::LayoutPlan>& plans = planned.plans;
  // Only what the queues' quotas admit tries placement.
  QueueStage::Held quota_held;
  if (snapshot.queues != nullptr) {
    quota_held = queue_stage_.Admit(*snapshot.queues, snapshot.queue_use, waiting, &requests);
  }
  std::vector<QueuedRequest>& held_requests = quota_held.requests;
  phase.Next("plan");
  ScheduleResult result;
  // What the scheduler cannot place may preempt lower priorities of its queue (PreemptLocked's
  // quota preemption goes first).
  std::vector<GangRequest> tried = requests;
  std::map<std::string, std::string> queue_of;
  for (const GangRequest& request : tried) {
    queue_of[request.job_id] = waiting.at(request.job_id)->queue();
  }
  if (!requests.empty()) result = Schedule(std::move(requests), std::move(capacity));
  std::set<std::string> placed_ids;
  for (const GangPlacement& placement : result.placed) placed_ids.insert(placement.job_id);
  std::erase_if(tried, [&](const GangRequest& r) { return placed_ids.contains(r.job_id); });
  result.pending_reasons.merge(quota_held.reasons);
  phase.Next("schedule");
  // The gangs are admitted (allocation made) under one short hold, unless a node registered again
  // (or was lost) since the snapshot: it may offer other devices now, and that gang waits for the
  // next pass. Only a pass adds or frees allocations, so the other gangs' devices are still free.
  // Their assignments are queued held back: they go out to their nodes only once the placements
  // are stored, so that no worker starts a task the store does not know, and no heartbeat waits
  // for the store (it leaves without them).
  std::vector<const GangPlacement*> admitted;
  std::map<std::string, int> master_ports;  // of the admitted placements, by job
  std::vector<JobManager::TransitionRequest> preempted;  // the victims' moves to PREEMPTED
  // Each placement's assignments (the spec and plan copied for every node) are made before the
  // hold; only the master port is filled in under it.
  std::vector<std::map<std::string, v1::TaskAssignment>> assignments;
  assignments.reserve(result.placed.size());
  for (const auto& placement : result.placed) {
    const std::string& job_id = placement.job_id;
    const v1::Job& job = *waiting.at(job_id);
    // Every rank skips the data that the job's rollbacks so far skipped.
    v1::JobSpec task_spec = specs[job_id];
    AddRollbackSkips(job, &task_spec);
    assignments.push_back(PlacementAssignments(job, task_spec, placement, plans[job_id],
                                               state_->options.checkpoint_root));
    StampMetricsComplete(*state_->store, job, assignments.back());
  }
  {
    TimedLock lock(&state_->mu, stats);
    for (size_t i = 0; i < result.placed.size(); ++i) {
      GangPlacement& placement = result.placed[i];
      bool stale = false;
      for (const auto& rank : placement.ranks) {
        stale = stale || state_->nodes.ChangedSince(rank.node_id(), snapshot.generation);
      }
      if (stale || state_->allocations.Find(placement.job_id) != nullptr) continue;
      IdentifyGpusLocked(placement.ranks);
      master_ports[placement.job_id] =
          AdmitLocked(*waiting.at(placement.job_id), specs[placement.job_id], placement,
                      std::move(assignments[i]));
      admitted.push_back(&placement);
      admitted_ids->insert(placement.job_id);
    }
    if (!held_requests.empty()) {
      PreemptLocked(snapshot, std::move(held_requests), &result.pending_reasons, &preempted);
    }
    if (preempted.empty()) {
      PreemptForCapacityLocked(snapshot, tried, queue_of, &result.pending_reasons, &preempted);
    }
  }
  phase.Next("admit");
  // Every placement and every changed pending reason of the pass is stored in one transaction
  // (one fsync), without the lock. Each write owns what it stores: under Start() it is stored
  // beside the next pass.
  Writes pass;
  for (const GangPlacement* placement : admitted) {
    const std::string& job_id = placement->job_id;
    pass.writes.push_back(
        {job_id, v1::JOB_STATE_SCHEDULED,
         PlacementReason(*waiting.at(job_id), specs[job_id], *placement, plans[job_id]),
         [plan = std::move(plans[job_id]), ranks = placement->ranks,
          port = master_ports[job_id]](v1::Job& stored) {
           *stored.mutable_plan() = plan;
           stored.mutable_placements()->Clear();
           for (const auto& rank : ranks) *stored.add_placements() = rank;
           stored.set_master_port(port);
         },
         nullptr});
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

std::set<std::string> SchedulingPass::StoreWrites(Writes pass) {
  std::set<std::string> placed;
  if (pass.writes.empty()) return placed;
  const std::vector<absl::StatusOr<v1::Job>> stored = jobs_->TransitionAll(pass.writes);
  std::function<void(double)> latency_observer;
  std::vector<double> latencies;
  std::function<void(const std::string&, double)> queue_wait_observer;
  // Each job placed: its queue and the seconds it waited there, for queue_wait_observer.
  std::vector<std::pair<std::string, double>> queue_waits;
  std::shared_ptr<const QueueConfig> queues =
      pass.placements > 0 && state_->options.queues != nullptr ? state_->options.queues->Current()
                                                               : nullptr;
  {
    absl::MutexLock lock(&state_->mu);
    latency_observer = latency_observer_;
    queue_wait_observer = queue_wait_observer_;
    for (size_t i = 0; i < pass.placements; ++i) {
      const std::string& job_id = pass.writes[i].job_id;
      Allocation* allocation = state_->allocations.Find(job_id);
      if (allocation != nullptr) allocation->storing = false;
      if (stored[i].ok()) {
        if (allocation != nullptr) {
          for (const auto& node : allocation->Nodes()) {
            state_->nodes.ReleaseStart(node, TaskId(job_id, allocation->attempt, node));
          }
        }
        placed.insert(job_id);
        if (stored[i]->attempt() == 0) {
          latencies.push_back(absl::ToDoubleSeconds(
              state_->Now() -
              absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(stored[i]->create_time()))));
        }
        if (queue_wait_observer) {
          // Attempt 0 entered its queue at submission, a later one when the previous ended.
          const google::protobuf::Timestamp& entered =
              stored[i]->attempts().empty() ? stored[i]->create_time()
                                            : stored[i]->attempts().rbegin()->end_time();
          queue_waits.emplace_back(
              queues != nullptr ? CountingQueue(stored[i]->queue(), *queues)
                                : std::string(kImplicitQueue),
              std::max(0.0, absl::ToDoubleSeconds(
                                state_->Now() -
                                absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(entered)))));
        }
        continue;
      }
      // Cancelled meanwhile (FAILED_PRECONDITION), or a store error: nothing was delivered (the
      // assignments were held back), so the gang is taken back and a later pass decides.
      if (!absl::IsFailedPrecondition(stored[i].status())) {
        LogRetried(stored[i].status(), absl::StrCat("placing job ", job_id));
      }
      if (allocation != nullptr) {
        for (const auto& node : allocation->Nodes()) {
          state_->nodes.WithdrawStart(node, TaskId(job_id, allocation->attempt, node));
        }
        state_->allocations.Erase(job_id);
      }
    }
  }
  if (latency_observer) {
    for (double seconds : latencies) latency_observer(seconds);
  }
  for (const auto& [queue, seconds] : queue_waits) queue_wait_observer(queue, seconds);
  for (size_t i = pass.placements; i < pass.writes.size(); ++i) {
    if (!stored[i].ok() && !absl::IsFailedPrecondition(stored[i].status())) {
      LogRetried(stored[i].status(),
                 absl::StrCat("recording why job ", pass.writes[i].job_id, " waits"));
    }
  }
  return placed;
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
    TimedLock lock(&state_->mu, &stats);
    endings = SettleLocked(count, now, active.ok() ? &active_ids : nullptr);
  }
  // The node records changed (registrations, nodes lost; a write that failed before) and the
  // attempts' ends are stored with the lock released: heartbeats go on meanwhile. An ending
  // attempt keeps its devices until then.
  LogRetried(state_->WriteNodes(), "writing node records");
  fate_->StoreEndings(endings, now);
  Snapshot snapshot;
  bool relist = false;
  {
    TimedLock lock(&state_->mu, &stats);
    relist = FreeEndedLocked(endings, active.ok() ? &active_ids : nullptr);
    if (active.ok() && !relist && waiting.ok()) snapshot = SnapshotLocked(*waiting, queues);
  }
  phase.Next("settle");
  if (relist) {
    active_ids.clear();  // views into the listing replaced here
    active = state_->store->ListActiveJobSummaries();
    waiting = state_->store->ListWaitingJobs();
    phase.Next("list");
    if (waiting.ok()) {
      TimedLock lock(&state_->mu, &stats);
      snapshot = SnapshotLocked(*waiting, queues);
    }
    phase.Next("settle");
  }
  if (active.ok() && waiting.ok()) {
    std::set<std::string> placed;
    Writes pass = PlanAndAdmit(*waiting, snapshot, &stats, &placed);
    phase = PhaseTimer(&stats);
    if (overlap_store) {
      // Counted as placed: the store thread takes a placement back only if its job was cancelled
      // meanwhile (or on a store error), which the next pass's counts show.
      if (!pass.writes.empty()) store_thread_.HandOver(std::move(pass));
    } else {
      placed = StoreWrites(std::move(pass));
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
  {
    TimedLock lock(&state_->mu, &stats);
    CountLocked(&stats);
  }
  // Ended jobs are counted by the store (the active ones above, as this pass left them).
  if (auto ended = state_->store->CountEndedJobs(); ended.ok()) {
    for (const auto& [state, count] : *ended) stats.jobs[state] = count;
  } else {
    LogRetried(ended.status(), "counting ended jobs");
  }
  phase.Next("count");
  return stats;
}

std::vector<AttemptFate::Ending> SchedulingPass::SettleLocked(
    bool count, absl::Time now, const absl::flat_hash_set<std::string_view>* active_ids) {
  fate_->AssertLockHeld();
  std::vector<AttemptFate::Ending> endings;
  // Liveness is a scan of every node: the regular passes (every tick_interval) do it.
  if (count) fate_->ExpireNodesLocked(now);
  if (active_ids == nullptr) return endings;
  for (auto& [job_id, allocation] : state_->allocations.all()) {
    // Placed by the previous pass and not yet stored (its job may still be listed PENDING, or
    // already cancelled): the store thread releases or takes it back first.
    if (allocation.storing) continue;
    if (!active_ids->contains(job_id)) {
      // Cancelled (or ended by a decision already recorded): stop what still runs.
      if (allocation.phase != Allocation::Phase::kDraining) fate_->DrainLocked(job_id, allocation);
      continue;
    }
    fate_->PrepareLocked(job_id, allocation, now, &endings);
  }
  return endings;
}

bool SchedulingPass::FreeEndedLocked(const std::vector<AttemptFate::Ending>& endings,
                                     const absl::flat_hash_set<std::string_view>* active_ids) {
  fate_->AssertLockHeld();
  fate_->FinishLocked(endings);
  if (active_ids == nullptr) return false;
  // Attempts whose every task has ended give their devices back. A job still active whose
  // attempt just ended (it restarts) may be placed again in this pass: list again for it.
  bool relist = false;
  state_->allocations.EraseIf([&](const std::string& job_id, const Allocation& allocation) {
    const bool ended = allocation.phase == Allocation::Phase::kDraining &&
                       allocation.AllNodesEnded() && !allocation.success_pending;
    relist = relist || (ended && active_ids->contains(job_id));
    return ended;
  });
  return relist;
}

void SchedulingPass::CountLocked(ClusterStats* stats) {
  // Counted in place: copying every node record (or capacity) here cost more than the pass.
  NodeRegistry::Tally tally = state_->nodes.Count(state_->allocations.Used());
  stats->nodes = std::move(tally.nodes);
  stats->gpus_total = tally.gpus_total;
  stats->gpus_allocated = tally.gpus_allocated;
  stats->cpu_slots_total = tally.cpu_slots_total;
  stats->cpu_slots_allocated = tally.cpu_slots_allocated;
  fate_->AssertLockHeld();
  stats->restarts = fate_->restarts();
  stats->failures = fate_->failures();
  for (auto& [job_id, allocation] : state_->allocations.all()) {
    if (allocation.phase != Allocation::Phase::kRunning || allocation.rank_times.empty()) {
      continue;
    }
    std::vector<v1::RankStepTime> ranks;
    for (const auto& [rank, time] : allocation.rank_times) ranks.push_back(time);
    stats->stragglers[job_id] =
        ComputeStraggler(std::move(ranks), state_->options.straggler_threshold);
  }
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

void SchedulingPass::SetSchedulingLatencyObserver(std::function<void(double)> observer) {
  absl::MutexLock lock(&state_->mu);
  latency_observer_ = std::move(observer);
}

void SchedulingPass::SetQueueWaitObserver(
    std::function<void(const std::string& queue, double seconds)> observer) {
  absl::MutexLock lock(&state_->mu);
  queue_wait_observer_ = std::move(observer);
}

}  // namespace tessera::coordinator
