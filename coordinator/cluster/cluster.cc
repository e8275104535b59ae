#include "coordinator/cluster/cluster.h"

#include <pthread.h>

#include <chrono>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "coordinator/jobs/attempt_policy.h"

namespace tessera::coordinator {

Cluster::Cluster(Store* store, JobManager* jobs, ClusterOptions options)
    : state_(store, std::move(options)),
      nodes_(store, state_.options.heartbeat_timeout, /*write_behind=*/true, state_.options.clock,
             &state_.orders),
      fate_(&state_, &nodes_, jobs),
      protocol_(&state_, &ledger_, &nodes_, jobs, &fate_),
      pass_(&state_, &ledger_, &nodes_, jobs, &fate_) {
  nodes_.SetTopologyLevels(state_.options.topology_levels);
}

Cluster::~Cluster() { Stop(); }

absl::Status Cluster::Recover() {
  RETURN_IF_ERROR(nodes_.Load());
  GuardedLedger::Hold held(&ledger_);
  const absl::Time now = state_.Now();
  ASSIGN_OR_RETURN(auto active, state_.store->ListActiveJobs());
  for (const auto& job : active) {
    if (job.placements().empty()) continue;
    Allocation allocation;
    allocation.attempt = job.attempt();
    allocation.queue = job.queue();
    allocation.priority = job.spec().priority();
    allocation.ranks.assign(job.placements().begin(), job.placements().end());
    allocation.master_node = job.placements(0).node_id();
    allocation.placed_time = now;
    // The job's newest checkpoint is where a stop would take it back to (the attempt may have
    // started after it, which the ledger no longer knows); without one, from the restart on.
    allocation.last_checkpoint_time = now;
    if (job.latest_checkpoint().has_create_time()) {
      allocation.last_checkpoint_time =
          std::min(now, FromProto(job.latest_checkpoint().create_time()));
    }
    allocation.start_step = job.current_step();
    // The port the workers' assignments hold, stored with the placement. A job placed by an
    // older coordinator has none stored: reserve the node's next free one for it.
    allocation.master_port =
        job.master_port() > 0
            ? job.master_port()
            : held->FreeMasterPort(allocation.master_node, state_.options.base_master_port);
    if (job.state() == v1::JOB_STATE_PREEMPTED) {
      // Preempted before the restart: its ranks are asked again to save and stop (a worker
      // already stopping them ignores the repeat), with the default deadline from now.
      allocation.preempted = job.reason().substr(0, job.reason().find(": saving a checkpoint"));
      allocation.preempted_time = now;
      allocation.preemption_deadline = kDefaultPreemptionCheckpointDeadline;
      Allocation& added = held->Add(job.job_id(), std::move(allocation));
      fate_.MoveLocked(held, job.job_id(), added);
      continue;
    }
    held->Add(job.job_id(), std::move(allocation));
  }
  return absl::OkStatus();
}

std::optional<v1::StragglerReport> Cluster::Straggler(const std::string& job_id) {
  GuardedLedger::Hold held(&ledger_);
  Allocation* allocation = held->Find(job_id);
  if (allocation == nullptr || allocation->rank_times.empty()) return std::nullopt;
  std::vector<v1::RankStepTime> ranks;
  for (const auto& [rank, time] : allocation->rank_times) ranks.push_back(time);
  return ComputeStraggler(std::move(ranks), state_.options.straggler_threshold);
}

std::vector<NodeCapacity> Cluster::Capacity() {
  UsedResources used;
  {
    GuardedLedger::Hold held(&ledger_);
    used = held->Used();
  }
  return nodes_.Capacity(used);
}

std::vector<v1::Node> Cluster::Nodes(bool include_lost) {
  std::map<std::string, std::set<std::string>> jobs_on;
  UsedResources used;
  {
    GuardedLedger::Hold held(&ledger_);
    for (const auto& [job_id, allocation] : held->all()) {
      for (const auto& rank : allocation.ranks) jobs_on[rank.node_id()].insert(job_id);
    }
    used = held->Used();
  }
  std::map<std::string, NodeCapacity> capacity;
  for (NodeCapacity& c : nodes_.Capacity(used)) capacity[c.node_id] = std::move(c);
  std::vector<v1::Node> nodes;
  for (v1::Node& node : nodes_.Nodes()) {
    if (node.state() == v1::NODE_STATE_LOST && !include_lost) continue;
    // A node registered between the two reads shows no free devices until the next call.
    if (auto it = capacity.find(node.node_id()); it != capacity.end()) {
      for (int gpu : it->second.free_gpus) node.add_free_gpus(gpu);
      node.set_free_cpu_slots(it->second.free_cpu_slots);
    }
    for (const auto& job_id : jobs_on[node.node_id()]) node.add_job_ids(job_id);
    nodes.push_back(std::move(node));
  }
  return nodes;
}

v1::Node Cluster::NodeView(const v1::Node& stored) {
  v1::Node node = stored;
  UsedResources used;
  {
    GuardedLedger::Hold held(&ledger_);
    used = held->Used();
    for (const auto& job_id : held->JobsOn(node.node_id())) node.add_job_ids(job_id);
  }
  for (const NodeCapacity& capacity : nodes_.Capacity(used)) {
    if (capacity.node_id != node.node_id()) continue;
    for (int gpu : capacity.free_gpus) node.add_free_gpus(gpu);
    node.set_free_cpu_slots(capacity.free_cpu_slots);
  }
  node.clear_key_sha256();
  return node;
}

absl::StatusOr<v1::DrainNodeResponse> Cluster::DrainNode(const std::string& node_id,
                                                         bool checkpoint,
                                                         const std::string& reason) {
  v1::DrainNodeResponse response;
  // Drained first: from here no pass places on the node (a placement computed before is
  // dropped by the reservation's ChangedSince check), so the moves below see every attempt.
  ASSIGN_OR_RETURN(const v1::Node drained, nodes_.SetDrained(node_id, true, reason));
  {
    GuardedLedger::Hold held(&ledger_);
    DrainLockedMoves(held, node_id, checkpoint, &response);
  }
  *response.mutable_node() = NodeView(drained);
  // The drained record is stored with the locks released (a failed write is retried by a pass).
  RETURN_IF_ERROR(nodes_.Flush(node_id));
  return response;
}

void Cluster::DrainLockedMoves(GuardedLedger::Hold& held, const std::string& node_id,
                               bool checkpoint, v1::DrainNodeResponse* response) {
  for (const auto& job_id : held->JobsOn(node_id)) {
    Allocation& allocation = *held->Find(job_id);
    // Only an attempt that runs as placed moves; one being stored, decided or stopped ends on its
    // own (a failing one restarts elsewhere: the drained node takes no placement).
    if (!checkpoint || allocation.storing || allocation.success_pending ||
        allocation.phase() != Allocation::Phase::kRunning) {
      if (allocation.phase() != Allocation::Phase::kDraining)
        response->add_remaining_job_ids(job_id);
      continue;
    }
    allocation.moving_off = node_id;
    fate_.MoveLocked(held, job_id, allocation);
    response->add_moving_job_ids(job_id);
  }
}

absl::StatusOr<v1::Node> Cluster::UndrainNode(const std::string& node_id) {
  ASSIGN_OR_RETURN(const v1::Node undrained, nodes_.SetDrained(node_id, false, ""));
  v1::Node node = NodeView(undrained);
  RETURN_IF_ERROR(nodes_.Flush(node_id));
  return node;
}

absl::Status Cluster::RemoveNode(const std::string& node_id) {
  // The registry checks the node (known; drained or LOST), the ledger that nothing is held on it,
  // before the store delete and again after it.
  return nodes_.Remove(node_id, [&]() -> absl::Status {
    GuardedLedger::Hold held(&ledger_);
    if (const std::vector<std::string> jobs = held->JobsOn(node_id); !jobs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", node_id, " still holds devices of job(s) ", absl::StrJoin(jobs, ", "),
          ": wait until they end or move (drain with checkpoint)"));
    }
    return absl::OkStatus();
  });
}

void Cluster::Start(std::function<void(const ClusterStats&, double)> observer) {
  pass_.StartStoreThread();
  loop_ = std::thread([this, observer = std::move(observer)] {
    // Named for profiles (perf, top -H): the pass is one thread.
    pthread_setname_np(pthread_self(), "scheduler");
    Clock* const clock = state_.options.clock;
    absl::Time last_start = clock->Now();
    absl::Time last_counted = last_start;
    while (true) {
      {
        absl::MutexLock lock(&wake_mu_);
        // The regular pass comes tick_interval after the previous one started; a requested one
        // as soon as min_tick_gap has passed since then.
        while (!stopping_) {
          absl::Time due = last_start + state_.options.tick_interval;
          if (pass_requested_) due = std::min(due, last_start + state_.options.min_tick_gap);
          if (clock->Now() >= due) break;
          // Until `due`, or at once when stopped or asked for a pass (which may bring it closer).
          const bool requested = pass_requested_;
          auto woken = [this, requested]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) {
            return stopping_ || pass_requested_ != requested;
          };
          clock->AwaitWithDeadline(&wake_mu_, absl::Condition(&woken), due);
        }
        if (stopping_) return;
        pass_requested_ = false;
      }
      last_start = clock->Now();
      // The cluster-wide counts are taken every tick_interval, not on every early pass.
      const bool count = last_start - last_counted >= state_.options.tick_interval;
      if (count) last_counted = last_start;
      auto start = std::chrono::steady_clock::now();
      ClusterStats stats = pass_.Run(count, /*overlap_store=*/true);
      RecordQueues(&stats);
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (observer) observer(stats, seconds);
    }
  });
}

void Cluster::RequestPass() {
  absl::MutexLock lock(&wake_mu_);
  if (pass_requested_) return;
  pass_requested_ = true;  // the loop's wait sees it as the lock is released
}

void Cluster::Stop() {
  {
    absl::MutexLock lock(&wake_mu_);
    stopping_ = true;
  }
  if (loop_.joinable()) loop_.join();
  pass_.StopStoreThread();
  // The usage since the last periodic save, for the next coordinator on this store.
  pass_.SaveFairShare();
}

absl::StatusOr<v1::RegisterNodeResponse> Cluster::Register(const v1::RegisterNodeRequest& request) {
  return protocol_.Register(request);
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  return protocol_.Heartbeat(request);
}

absl::StatusOr<v1::ReportResponse> Cluster::Report(const v1::ReportRequest& request) {
  return protocol_.Report(request);
}

absl::Status Cluster::CheckWatcher(const std::string& node_id, const std::string& node_key) {
  return protocol_.CheckWatcher(node_id, node_key);
}

ClusterStats Cluster::Tick(bool count) {
  ClusterStats stats = pass_.Run(count, /*overlap_store=*/false);
  RecordQueues(&stats);
  return stats;
}

void Cluster::RecordQueues(ClusterStats* stats) {
  std::shared_ptr<const QueueConfig> config =
      state_.options.queues != nullptr ? state_.options.queues->Current() : nullptr;
  const bool implicit = config == nullptr || config->implicit();
  // A pass that could not list the jobs counted no queue: the previous figures stay.
  if (!implicit && stats->queues.empty()) return;
  std::map<std::string, ClusterStats::QueueFigures> figures;
  ClusterStats::QueueFigures& implicit_queue = figures[std::string(kImplicitQueue)];
  {
    // The ledger keeps each queue's allocations and devices as they are added and erased:
    // O(queues) here, not O(jobs).
    GuardedLedger::Hold held(&ledger_);
    for (const auto& [queue, hold] : held->HeldByQueue()) {
      if (!implicit) {
        auto it = stats->queues.find(CountingQueue(queue, *config));
        if (it != stats->queues.end()) it->second.running_jobs += hold.allocations;
        continue;
      }
      // Without quotas the pass counts nothing per queue: every allocation is the implicit
      // queue's, stopping ones holding their devices as in SchedulingPass.
      implicit_queue.running_jobs += hold.allocations;
      implicit_queue.used += hold.held;
    }
  }
  if (implicit) {
    for (v1::JobState state : {v1::JOB_STATE_PENDING, v1::JOB_STATE_RESTARTING}) {
      if (auto it = stats->jobs.find(state); it != stats->jobs.end()) {
        implicit_queue.waiting_jobs += it->second;
      }
    }
  } else {
    figures = stats->queues;
  }
  absl::MutexLock lock(&queues_mu_);
  queue_figures_ = std::move(figures);
}

v1::ListQueuesResponse Cluster::ListQueues() {
  std::shared_ptr<const QueueConfig> config =
      state_.options.queues != nullptr ? state_.options.queues->Current() : nullptr;
  std::map<std::string, ClusterStats::QueueFigures> figures;
  {
    absl::MutexLock lock(&queues_mu_);
    figures = queue_figures_;
  }
  if (config == nullptr) config = std::make_shared<const QueueConfig>();
  return QueueStatuses(*config, figures,
                       state_.options.queues != nullptr ? state_.options.queues->path() : "");
}

void Cluster::SetAssignmentNotifier(AssignmentNotifier* notifier) {
  state_.orders.SetNotifier(notifier);
}

void Cluster::SetFollowUpExecutor(CallExecutor* executor) {
  protocol_.SetFollowUpExecutor(executor);
}

void Cluster::SetSchedulingLatencyObserver(std::function<void(double)> observer) {
  pass_.SetSchedulingLatencyObserver(std::move(observer));
}

void Cluster::SetQueueWaitObserver(
    std::function<void(const std::string& queue, double seconds)> observer) {
  pass_.SetQueueWaitObserver(std::move(observer));
}

}  // namespace tessera::coordinator
