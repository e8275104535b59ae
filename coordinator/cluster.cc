#include "coordinator/cluster.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "coordinator/layout_planning.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp ToProto(absl::Time time) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

std::string HostOf(const std::string& address) {
  size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

Cluster::Cluster(Store* store, JobManager* jobs, ClusterOptions options)
    : store_(store), jobs_(jobs), options_(std::move(options)) {}

Cluster::~Cluster() { Stop(); }

std::string Cluster::TaskId(const std::string& job_id, int32_t attempt, const std::string& node) {
  return absl::StrCat(job_id, "/", attempt, "/", node);
}

absl::Status Cluster::Recover() {
  absl::MutexLock lock(&mu_);
  absl::Time now = options_.now();
  ASSIGN_OR_RETURN(auto nodes, store_->ListNodes());
  for (auto& node : nodes) {
    NodeEntry& entry = nodes_[node.node_id()];
    entry.node = std::move(node);
    entry.last_heartbeat = now;
  }
  ASSIGN_OR_RETURN(auto active, store_->ListActiveJobs());
  for (const auto& job : active) {
    if (job.placements().empty()) continue;
    Allocation& allocation = allocations_[job.job_id()];
    allocation.attempt = job.attempt();
    allocation.ranks.assign(job.placements().begin(), job.placements().end());
    allocation.master_node = job.placements(0).node_id();
    // The port is in the assignments the workers hold; reserve the node's
    // next one so a new job never reuses it.
    allocation.master_port = MasterPortLocked(allocation.master_node);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RegisterNodeResponse> Cluster::Register(const v1::RegisterNodeRequest& request) {
  if (request.node_id().empty()) return absl::InvalidArgumentError("node_id: required");
  if (request.address().empty()) return absl::InvalidArgumentError("address: required");
  if (request.resources().gpus().empty() && request.resources().cpu_slots() <= 0) {
    return absl::InvalidArgumentError("resources: a node must offer GPUs or cpu_slots");
  }
  absl::MutexLock lock(&mu_);
  absl::Time now = options_.now();
  NodeEntry& entry = nodes_[request.node_id()];
  v1::Node& node = entry.node;
  bool returning = !node.node_id().empty();
  node.set_node_id(request.node_id());
  node.set_hostname(request.hostname());
  node.set_address(request.address());
  node.set_state(v1::NODE_STATE_READY);
  *node.mutable_resources() = request.resources();
  node.mutable_labels()->clear();
  for (const auto& [key, value] : request.labels()) (*node.mutable_labels())[key] = value;
  node.set_worker_version(request.worker_version());
  if (!returning) *node.mutable_register_time() = ToProto(now);
  *node.mutable_last_heartbeat_time() = ToProto(now);
  entry.last_heartbeat = now;
  RETURN_IF_ERROR(store_->PutNode(node));
  // A worker that registers again without a task it was given has lost it
  // (the worker restarted): the job cannot go on.
  std::set<std::string> reported;
  for (const auto& task : request.running_tasks()) reported.insert(task.task_id());
  std::vector<std::string> lost;
  for (const auto& [job_id, allocation] : allocations_) {
    std::string task_id = TaskId(job_id, allocation.attempt, request.node_id());
    bool on_node = false;
    for (const auto& rank : allocation.ranks) on_node |= rank.node_id() == request.node_id();
    bool undelivered = false;
    for (const auto& start : entry.to_start) undelivered |= start.task_id() == task_id;
    if (on_node && !undelivered && !reported.contains(task_id)) lost.push_back(job_id);
  }
  for (const auto& job_id : lost) {
    v1::TrainerFailure failure;
    failure.set_kind(v1::FAILURE_KIND_PROCESS_EXIT);
    failure.set_rank(-1);
    failure.set_node_id(request.node_id());
    failure.set_message("the worker restarted and no longer runs its trainers");
    FailJobLocked(job_id, failure,
                  absl::StrCat("worker on ", request.node_id(),
                               " restarted and no longer runs the job's trainers"));
  }
  for (const auto& task : request.running_tasks()) OnTaskStatusLocked(request.node_id(), task);
  v1::RegisterNodeResponse response;
  response.set_node_id(request.node_id());
  response.set_heartbeat_interval_seconds(absl::ToDoubleSeconds(options_.heartbeat_interval));
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  v1::HeartbeatResponse response;
  auto it = nodes_.find(request.node_id());
  if (it == nodes_.end() || it->second.node.state() == v1::NODE_STATE_LOST) {
    // Unknown, or declared lost (its work was failed): start over.
    response.set_reregister(true);
    return response;
  }
  NodeEntry& entry = it->second;
  absl::Time now = options_.now();
  entry.last_heartbeat = now;
  *entry.node.mutable_last_heartbeat_time() = ToProto(now);
  entry.node.mutable_gpu_metrics()->CopyFrom(request.gpu_metrics());
  for (const auto& task : request.tasks()) OnTaskStatusLocked(request.node_id(), task);
  for (auto& start : entry.to_start) *response.add_start() = std::move(start);
  for (auto& stop : entry.to_stop) response.add_stop(std::move(stop));
  entry.to_start.clear();
  entry.to_stop.clear();
  return response;
}

void Cluster::OnTaskStatusLocked(const std::string& node_id, const v1::TaskStatus& status) {
  auto it = allocations_.find(status.job_id());
  if (it == allocations_.end() || it->second.attempt != status.attempt()) {
    // A task the coordinator no longer wants (cancelled, failed elsewhere,
    // or from before a restart of the job): stop it.
    if (status.state() == v1::TASK_STATE_STARTING || status.state() == v1::TASK_STATE_RUNNING) {
      nodes_[node_id].to_stop.push_back(status.task_id());
    }
    return;
  }
  Allocation& allocation = it->second;
  allocation.task_states[node_id] = status.state();
  const std::string job_id = status.job_id();
  if (status.state() == v1::TASK_STATE_FAILED) {
    v1::TrainerFailure failure = status.failure();
    if (failure.node_id().empty()) failure.set_node_id(node_id);
    FailJobLocked(job_id, failure,
                  absl::StrCat("task on ", node_id, " failed: ",
                               v1::FailureKind_Name(failure.kind()), " ", failure.message()));
    return;
  }
  std::set<std::string> job_nodes;
  for (const auto& rank : allocation.ranks) job_nodes.insert(rank.node_id());
  auto all_in = [&](v1::TaskState state) {
    for (const auto& node : job_nodes) {
      auto found = allocation.task_states.find(node);
      if (found == allocation.task_states.end() || found->second != state) return false;
    }
    return true;
  };
  if (all_in(v1::TASK_STATE_SUCCEEDED)) {
    (void)jobs_->Transition(job_id, v1::JOB_STATE_SUCCEEDED, "every rank finished");
    allocations_.erase(job_id);
  } else if (!allocation.running_seen && all_in(v1::TASK_STATE_RUNNING)) {
    // Once per allocation: every heartbeat of a running job would otherwise read the store.
    auto job = store_->GetJob(job_id);
    if (!job.ok()) return;
    if (job->state() == v1::JOB_STATE_SCHEDULED) {
      if (!jobs_
               ->Transition(job_id, v1::JOB_STATE_RUNNING,
                            absl::StrCat("all ", allocation.ranks.size(), " ranks running"))
               .ok()) {
        return;
      }
    }
    allocation.running_seen = true;
  }
}

absl::StatusOr<v1::ReportResponse> Cluster::Report(const v1::ReportRequest& request) {
  if (request.reports().empty()) return v1::ReportResponse();
  std::map<std::string, std::vector<v1::StepMetrics>> metrics;
  std::map<std::string, std::vector<v1::EvalMetrics>> evals;
  std::map<std::string, std::vector<v1::Checkpoint>> checkpoints;
  for (const auto& report : request.reports()) {
    const std::string& job_id = report.job_id();
    if (job_id.empty()) return absl::InvalidArgumentError("reports[].job_id: required");
    switch (report.report_case()) {
      case v1::TrainerReport::kMetrics:
        metrics[job_id].push_back(report.metrics());
        break;
      case v1::TrainerReport::kEval:
        evals[job_id].push_back(report.eval());
        break;
      case v1::TrainerReport::kCheckpoint:
        checkpoints[job_id].push_back(report.checkpoint());
        break;
      case v1::TrainerReport::kStarted: {
        // Rank 0 starts training only after every rank joined the process
        // group: the whole gang runs.
        auto job = store_->GetJob(job_id);
        if (report.rank() == 0 && job.ok() && job->state() == v1::JOB_STATE_SCHEDULED) {
          (void)jobs_->Transition(
              job_id, v1::JOB_STATE_RUNNING,
              absl::StrCat("all ", job->placements_size(), " ranks joined; training from step ",
                           report.started().start_step()));
        }
        break;
      }
      case v1::TrainerReport::kFailure: {
        absl::MutexLock lock(&mu_);
        v1::TrainerFailure failure = report.failure();
        if (failure.node_id().empty()) failure.set_node_id(request.node_id());
        FailJobLocked(job_id, failure,
                      absl::StrCat("rank ", failure.rank(), " on ", failure.node_id(), ": ",
                                   v1::FailureKind_Name(failure.kind()), ": ", failure.message()));
        break;
      }
      default:
        break;
    }
  }
  std::set<std::string> job_ids;
  for (const auto& [id, _] : metrics) job_ids.insert(id);
  for (const auto& [id, _] : evals) job_ids.insert(id);
  for (const auto& [id, _] : checkpoints) job_ids.insert(id);
  for (const auto& id : job_ids) {
    RETURN_IF_ERROR(jobs_->RecordReports(id, metrics[id], evals[id], checkpoints[id]));
  }
  v1::ReportResponse response;
  response.set_acked_sequence(request.first_sequence() + request.reports_size() - 1);
  return response;
}

void Cluster::FailJobLocked(const std::string& job_id, const v1::TrainerFailure& failure,
                            const std::string& reason) {
  (void)jobs_->Transition(job_id, v1::JOB_STATE_FAILED, reason,
                          [&](v1::Job& job) { *job.mutable_failure() = failure; });
  ReleaseLocked(job_id);
}

void Cluster::ReleaseLocked(const std::string& job_id) {
  auto it = allocations_.find(job_id);
  if (it == allocations_.end()) return;
  std::set<std::string> job_nodes;
  for (const auto& rank : it->second.ranks) job_nodes.insert(rank.node_id());
  for (const auto& node : job_nodes) {
    auto entry = nodes_.find(node);
    if (entry == nodes_.end()) continue;
    std::string task_id = TaskId(job_id, it->second.attempt, node);
    // A start not yet delivered is simply withdrawn.
    auto& starts = entry->second.to_start;
    auto pending = std::remove_if(starts.begin(), starts.end(), [&](const v1::TaskAssignment& a) {
      return a.task_id() == task_id;
    });
    bool delivered = pending == starts.end();
    starts.erase(pending, starts.end());
    if (delivered) entry->second.to_stop.push_back(task_id);
  }
  allocations_.erase(it);
}

std::vector<NodeCapacity> Cluster::CapacityLocked() {
  std::map<std::string, std::set<int>> used_gpus;
  std::map<std::string, int> used_slots;
  for (const auto& [job_id, allocation] : allocations_) {
    for (const auto& rank : allocation.ranks) {
      if (rank.gpu_index() >= 0) {
        used_gpus[rank.node_id()].insert(rank.gpu_index());
      } else {
        ++used_slots[rank.node_id()];
      }
    }
  }
  std::vector<NodeCapacity> capacity;
  for (const auto& [node_id, entry] : nodes_) {
    const v1::Node& node = entry.node;
    NodeCapacity c;
    c.node_id = node_id;
    c.host = HostOf(node.address());
    c.host_memory_bytes = node.resources().memory_bytes();
    c.total_gpus = node.resources().gpus_size();
    for (const auto& gpu : node.resources().gpus()) {
      if (!used_gpus[node_id].contains(gpu.index())) c.free_gpus.push_back(gpu.index());
      if (c.gpu_name.empty()) {
        c.gpu_name = gpu.name();
        c.gpu_memory_bytes = gpu.memory_bytes();
      }
    }
    c.total_cpu_slots = node.resources().cpu_slots();
    c.free_cpu_slots = std::max(0, c.total_cpu_slots - used_slots[node_id]);
    c.labels.insert(node.labels().begin(), node.labels().end());
    c.schedulable = node.state() == v1::NODE_STATE_READY;
    capacity.push_back(std::move(c));
  }
  return capacity;
}

int Cluster::MasterPortLocked(const std::string& node_id) {
  std::set<int> used;
  for (const auto& [job_id, allocation] : allocations_) {
    if (allocation.master_node == node_id) used.insert(allocation.master_port);
  }
  int port = options_.base_master_port;
  while (used.contains(port)) ++port;
  return port;
}

void Cluster::ExpireNodesLocked(absl::Time now) {
  for (auto& [node_id, entry] : nodes_) {
    if (entry.node.state() == v1::NODE_STATE_LOST) continue;
    if (now - entry.last_heartbeat <= options_.heartbeat_timeout) continue;
    entry.node.set_state(v1::NODE_STATE_LOST);
    entry.to_start.clear();
    entry.to_stop.clear();
    (void)store_->PutNode(entry.node);
    std::string reason = absl::StrCat("node ", node_id, " lost: no heartbeat for ",
                                      absl::FormatDuration(now - entry.last_heartbeat));
    std::vector<std::string> affected;
    for (const auto& [job_id, allocation] : allocations_) {
      for (const auto& rank : allocation.ranks) {
        if (rank.node_id() == node_id) {
          affected.push_back(job_id);
          break;
        }
      }
    }
    for (const auto& job_id : affected) {
      v1::TrainerFailure failure;
      failure.set_kind(v1::FAILURE_KIND_NODE_LOST);
      failure.set_rank(-1);
      failure.set_node_id(node_id);
      failure.set_message(reason);
      FailJobLocked(job_id, failure, reason);
    }
  }
}

void Cluster::PlaceLocked(const v1::Job& job, const GangPlacement& placement,
                          const v1::LayoutPlan& plan) {
  Allocation allocation;
  allocation.attempt = job.attempt();
  allocation.ranks = placement.ranks;
  allocation.master_node = placement.ranks.front().node_id();
  allocation.master_port = MasterPortLocked(allocation.master_node);
  std::vector<std::string> node_order;
  std::map<std::string, int> local_world;
  for (const auto& rank : placement.ranks) {
    if (local_world[rank.node_id()]++ == 0) node_order.push_back(rank.node_id());
  }
  auto transitioned = jobs_->Transition(job.job_id(), v1::JOB_STATE_SCHEDULED,
                                        absl::StrCat("placed on ", absl::StrJoin(node_order, ", ")),
                                        [&](v1::Job& stored) {
                                          *stored.mutable_plan() = plan;
                                          stored.mutable_placements()->Clear();
                                          for (const auto& rank : placement.ranks)
                                            *stored.add_placements() = rank;
                                        });
  if (!transitioned.ok()) return;
  const std::string checkpoint_dir = job.spec().checkpoint().directory().empty()
                                         ? absl::StrCat(options_.checkpoint_root, "/", job.job_id())
                                         : job.spec().checkpoint().directory();
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const auto& rank : placement.ranks) {
    v1::TaskAssignment& assignment = assignments[rank.node_id()];
    assignment.set_task_id(TaskId(job.job_id(), job.attempt(), rank.node_id()));
    v1::TrainerTask* task = assignment.add_trainers();
    task->set_job_id(job.job_id());
    task->set_attempt(job.attempt());
    *task->mutable_spec() = job.spec();
    *task->mutable_plan() = plan;
    task->set_checkpoint_directory(checkpoint_dir);
    v1::RankAssignment* ra = task->mutable_assignment();
    ra->set_rank(rank.rank());
    ra->set_world_size(static_cast<int>(placement.ranks.size()));
    ra->set_local_rank(rank.local_rank());
    ra->set_local_world_size(local_world[rank.node_id()]);
    ra->set_master_addr(placement.master_addr);
    ra->set_master_port(allocation.master_port);
    ra->set_device_type(rank.gpu_index() >= 0 ? v1::DEVICE_TYPE_CUDA : v1::DEVICE_TYPE_CPU);
    ra->set_gpu_index(rank.gpu_index());
  }
  for (auto& [node_id, assignment] : assignments) {
    nodes_[node_id].to_start.push_back(std::move(assignment));
  }
  allocations_[job.job_id()] = std::move(allocation);
  std::function<void(double)> observer = latency_observer_;
  if (observer) {
    absl::Time submitted = absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(job.create_time()));
    observer(absl::ToDoubleSeconds(options_.now() - submitted));
  }
}

const absl::StatusOr<v1::LayoutPlan>& Cluster::CachedPlanLocked(
    const v1::Job& job, const absl::StatusOr<planner::DeviceTarget>& target) {
  // A job's spec never changes, so its plan changes only with the device it is planned for.
  const std::string fingerprint =
      target.ok() ? absl::StrCat(target->device.SerializeAsString(), "|", target->devices_per_node,
                                 "|", target->gpu_name)
                  : target.status().ToString();
  CachedPlan& cached = plan_cache_[job.job_id()];
  if (!cached.plan.has_value() || cached.fingerprint != fingerprint) {
    cached.fingerprint = fingerprint;
    cached.plan = PlanForTarget(job.spec(), target);
  }
  return *cached.plan;
}

std::set<std::string> Cluster::ScheduleLocked(const std::vector<v1::Job>& active) {
  std::vector<GangRequest> requests;
  std::map<std::string, const v1::Job*> pending;
  // The plan each pending job starts with, fitted to the devices registered now.
  std::map<std::string, v1::LayoutPlan> plans;
  std::map<std::string, std::string> unfit;
  const bool any_pending = std::any_of(active.begin(), active.end(), [](const v1::Job& job) {
    return job.state() == v1::JOB_STATE_PENDING;
  });
  if (!any_pending) return {};
  const std::vector<NodeCapacity> capacity = CapacityLocked();
  // Jobs asking for the same kind of device share one look over the nodes.
  std::map<std::string, absl::StatusOr<planner::DeviceTarget>> targets;
  std::set<std::string> pending_ids;
  for (const auto& job : active) {
    if (job.state() != v1::JOB_STATE_PENDING) continue;
    pending_ids.insert(job.job_id());
    const v1::ResourceRequest& resources = job.spec().resources();
    GangRequest request;
    request.job_id = job.job_id();
    request.priority = job.spec().priority();
    request.submit_order = TimeUtil::TimestampToNanoseconds(job.create_time());
    request.use_gpus = resources.gpus() > 0;
    request.gpu_type = resources.gpu_type();
    request.node_selector.insert(resources.node_selector().begin(),
                                 resources.node_selector().end());
    const std::string key = NodeKindKey(request);
    auto target = targets.find(key);
    if (target == targets.end()) {
      target = targets.emplace(key, TargetFromNodes(job.spec(), capacity)).first;
    }
    // Automatic layouts are chosen for the devices the job would get; explicit ones are checked
    // against them. A job that cannot be planned here (no matching node yet, a GPU without a
    // device model) keeps its provisional plan and the scheduler says why it waits.
    v1::LayoutPlan& plan = plans[job.job_id()];
    plan = job.plan();
    const absl::StatusOr<v1::LayoutPlan>& fitted = CachedPlanLocked(job, target->second);
    if (fitted.ok()) {
      if (!fitted->fits()) {
        unfit[job.job_id()] = fitted->explanation();
        continue;
      }
      plan = *fitted;
    }
    pending[job.job_id()] = &job;
    request.world_size = std::max(1, plan.world_size());
    request.tensor_parallel = std::max(1, plan.layout().tensor_parallel());
    requests.push_back(std::move(request));
  }
  // Plans of jobs that left the queue are not needed again.
  std::erase_if(plan_cache_, [&](const auto& entry) { return !pending_ids.contains(entry.first); });
  ScheduleResult result;
  if (!requests.empty()) result = Schedule(std::move(requests), capacity);
  std::set<std::string> placed;
  for (const auto& placement : result.placed) {
    PlaceLocked(*pending[placement.job_id], placement, plans[placement.job_id]);
    placed.insert(placement.job_id);
  }
  result.pending_reasons.merge(unfit);
  std::map<std::string, const v1::Job*> by_id;
  for (const auto& job : active) by_id[job.job_id()] = &job;
  for (const auto& [job_id, reason] : result.pending_reasons) {
    const v1::Job* job = by_id[job_id];
    if (job != nullptr && job->reason() != reason) {
      (void)jobs_->Transition(job_id, v1::JOB_STATE_PENDING, reason);
    }
  }
  return placed;
}

ClusterStats Cluster::Tick() {
  absl::MutexLock lock(&mu_);
  ExpireNodesLocked(options_.now());
  ClusterStats stats;
  auto active = store_->ListActiveJobs();
  if (active.ok()) {
    // Work of jobs that ended (cancelled, failed) is stopped and freed.
    std::set<std::string> active_ids;
    for (const auto& job : *active) active_ids.insert(job.job_id());
    std::vector<std::string> ended;
    for (const auto& [job_id, _] : allocations_) {
      if (!active_ids.contains(job_id)) ended.push_back(job_id);
    }
    for (const auto& job_id : ended) ReleaseLocked(job_id);
    const std::set<std::string> placed = ScheduleLocked(*active);
    for (const auto& job : *active) {
      ++stats.jobs[placed.contains(job.job_id()) ? v1::JOB_STATE_SCHEDULED : job.state()];
    }
  }
  for (const auto& capacity : CapacityLocked()) {
    stats.gpus_total += capacity.total_gpus;
    stats.gpus_allocated += capacity.total_gpus - static_cast<int64_t>(capacity.free_gpus.size());
    stats.cpu_slots_total += capacity.total_cpu_slots;
    stats.cpu_slots_allocated += capacity.total_cpu_slots - capacity.free_cpu_slots;
  }
  for (const auto& [node_id, entry] : nodes_) ++stats.nodes[entry.node.state()];
  return stats;
}

std::vector<NodeCapacity> Cluster::Capacity() {
  absl::MutexLock lock(&mu_);
  return CapacityLocked();
}

std::vector<v1::Node> Cluster::Nodes(bool include_lost) {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::set<std::string>> jobs_on;
  for (const auto& [job_id, allocation] : allocations_) {
    for (const auto& rank : allocation.ranks) jobs_on[rank.node_id()].insert(job_id);
  }
  std::vector<v1::Node> nodes;
  for (const auto& capacity : CapacityLocked()) {
    const v1::Node& stored = nodes_[capacity.node_id].node;
    if (stored.state() == v1::NODE_STATE_LOST && !include_lost) continue;
    v1::Node node = stored;
    for (int gpu : capacity.free_gpus) node.add_free_gpus(gpu);
    node.set_free_cpu_slots(capacity.free_cpu_slots);
    for (const auto& job_id : jobs_on[capacity.node_id]) node.add_job_ids(job_id);
    nodes.push_back(std::move(node));
  }
  return nodes;
}

void Cluster::Start(std::function<void(const ClusterStats&, double)> observer) {
  loop_ = std::thread([this, observer = std::move(observer)] {
    while (!stop_.WaitForNotificationWithTimeout(options_.tick_interval)) {
      auto start = std::chrono::steady_clock::now();
      ClusterStats stats = Tick();
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (observer) observer(stats, seconds);
    }
  });
}

void Cluster::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (loop_.joinable()) loop_.join();
}

void Cluster::SetSchedulingLatencyObserver(std::function<void(double)> observer) {
  absl::MutexLock lock(&mu_);
  latency_observer_ = std::move(observer);
}

}  // namespace tessera::coordinator
