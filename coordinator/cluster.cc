#include "coordinator/cluster.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "coordinator/attempt_policy.h"
#include "coordinator/auth.h"
#include "coordinator/layout_planning.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp ToProto(absl::Time time) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

// A store write whose failure the next tick repairs: worth a log line, not a crash or a lost job.
void LogRetried(const absl::Status& status, const std::string& what) {
  if (!status.ok()) {
    std::cerr << "tessera-coordinator: " << what << ": " << status << " (retried next tick)"
              << std::endl;
  }
}

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

bool ResumesFromCheckpoints(const v1::JobSpec& spec) {
  return !spec.checkpoint().has_resume() || spec.checkpoint().resume();
}

bool AutomaticLayout(const v1::JobSpec& spec) { return !spec.parallelism().has_layout(); }

// `spec` asking for `devices` devices of the kind it runs on.
v1::JobSpec WithDevices(v1::JobSpec spec, int devices) {
  if (spec.resources().gpus() > 0) {
    spec.mutable_resources()->set_gpus(devices);
  } else {
    spec.mutable_resources()->set_cpu_slots(devices);
  }
  return spec;
}

int RequestedDevices(const v1::JobSpec& spec) {
  return spec.resources().gpus() > 0 ? spec.resources().gpus() : spec.resources().cpu_slots();
}

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

// The history entry of `allocation`'s attempt of `job`, ended at `now` for `reason`.
v1::JobAttempt EndedAttempt(const Allocation& allocation, const v1::Job& job, absl::Time now,
                            const std::string& reason) {
  v1::JobAttempt record;
  record.set_attempt(allocation.attempt);
  for (const auto& node : allocation.Nodes()) record.add_node_ids(node);
  record.set_world_size(static_cast<int>(allocation.ranks.size()));
  *record.mutable_layout() = job.plan().layout();
  record.set_start_step(allocation.start_step);
  record.set_end_step(job.current_step());
  *record.mutable_start_time() = ToProto(allocation.placed_time);
  *record.mutable_end_time() = ToProto(now);
  record.set_reason(reason);
  return record;
}

}  // namespace

Cluster::Cluster(Store* store, JobManager* jobs, ClusterOptions options)
    : store_(store),
      jobs_(jobs),
      options_(std::move(options)),
      nodes_(store, options_.heartbeat_timeout) {
  // The registry calls this under mu_ (it is only ever used under mu_).
  nodes_.SetOrdersListener([this](const std::string& node_id) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (notifier_ != nullptr && node_id != heartbeat_node_) notifier_->Notify(node_id);
  });
}

Cluster::~Cluster() { Stop(); }

std::string Cluster::TaskId(const std::string& job_id, int32_t attempt, const std::string& node) {
  return absl::StrCat(job_id, "/", attempt, "/", node);
}

absl::Status Cluster::Recover() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.now();
  RETURN_IF_ERROR(nodes_.Load(now));
  ASSIGN_OR_RETURN(auto active, store_->ListActiveJobs());
  for (const auto& job : active) {
    if (job.placements().empty()) continue;
    Allocation allocation;
    allocation.attempt = job.attempt();
    allocation.ranks.assign(job.placements().begin(), job.placements().end());
    allocation.master_node = job.placements(0).node_id();
    allocation.placed_time = now;
    allocation.start_step = job.current_step();
    // The port the workers' assignments hold, stored with the placement. A job placed by an
    // older coordinator has none stored: reserve the node's next free one for it.
    allocation.master_port =
        job.master_port() > 0
            ? job.master_port()
            : allocations_.FreeMasterPort(allocation.master_node, options_.base_master_port);
    allocations_.Add(job.job_id(), std::move(allocation));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RegisterNodeResponse> Cluster::Register(const v1::RegisterNodeRequest& request) {
  if (request.node_id().empty()) return absl::InvalidArgumentError("node_id: required");
  if (request.address().empty()) return absl::InvalidArgumentError("address: required");
  if (request.resources().gpus().empty() && request.resources().cpu_slots() <= 0) {
    return absl::InvalidArgumentError("resources: a node must offer GPUs or cpu_slots");
  }
  FollowUps follow_ups;
  absl::Cleanup finish = [&] { FinishFollowUps(follow_ups); };
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.now();
  bool returning = false;
  RETURN_IF_ERROR(nodes_.Register(request, now, &returning));
  // A worker that registers again without a task it was given has lost it
  // (the worker restarted): that attempt cannot go on.
  std::set<std::string> reported;
  for (const auto& task : request.running_tasks()) reported.insert(task.task_id());
  for (const auto& job_id : allocations_.JobsOn(request.node_id())) {
    Allocation* found = allocations_.Find(job_id);
    if (found == nullptr) continue;
    Allocation& allocation = *found;
    const std::string task_id = TaskId(job_id, allocation.attempt, request.node_id());
    if (nodes_.StartQueued(request.node_id(), task_id) || reported.contains(task_id)) continue;
    if (allocation.NodeEnded(request.node_id())) continue;
    allocation.task_states[request.node_id()] = v1::TASK_STATE_FAILED;
    if (allocation.phase == Allocation::Phase::kDraining) continue;
    v1::TrainerFailure failure;
    failure.set_kind(v1::FAILURE_KIND_PROCESS_EXIT);
    failure.set_rank(-1);
    failure.set_node_id(request.node_id());
    failure.set_message("the worker restarted and no longer runs the job's trainers");
    *failure.mutable_time() = ToProto(now);
    AddFailureLocked(job_id, allocation.attempt, failure);
  }
  for (const auto& task : request.running_tasks()) {
    OnTaskStatusLocked(request.node_id(), task, &follow_ups);
  }
  v1::RegisterNodeResponse response;
  response.set_node_id(request.node_id());
  response.set_heartbeat_interval_seconds(absl::ToDoubleSeconds(options_.heartbeat_interval));
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Cluster::Heartbeat(const v1::HeartbeatRequest& request) {
  // Declared first: the store writes the heartbeat decided run after mu_ is released, on the
  // follow-up executor when there is one.
  FollowUps follow_ups;
  absl::Cleanup finish = [&] {
    if (follow_ups.running.empty() && follow_ups.succeeded.empty()) return;
    CallExecutor* executor = follow_up_executor_.load();
    if (executor == nullptr) return FinishFollowUps(follow_ups);
    executor->Schedule([this, follow_ups = std::move(follow_ups)] { FinishFollowUps(follow_ups); });
  };
  // Hashed and copied before the lock: every heartbeat holds it, and the hash was most of a
  // hold. The metrics are copied into this thread's scratch, which Touch swaps with the node's:
  // the scratch then holds the node's previous ones, whose messages the next copy reuses, so a
  // heartbeat allocates nothing for them.
  const std::string key_sha256 = TokenSha256(request.node_key());
  thread_local google::protobuf::RepeatedPtrField<v1::GpuMetrics> gpu_metrics;
  gpu_metrics.CopyFrom(request.gpu_metrics());
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(nodes_.CheckKey(request.node_id(), key_sha256));
  heartbeat_node_ = request.node_id();
  absl::Cleanup quiet = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { heartbeat_node_.clear(); };
  v1::HeartbeatResponse response;
  if (!nodes_.Touch(request.node_id(), options_.now(), &gpu_metrics)) {
    // Unknown, or declared lost (its work was failed): start over.
    response.set_reregister(true);
    return response;
  }
  std::set<std::string> listed;
  for (const auto& task : request.tasks()) {
    listed.insert(task.task_id());
    OnTaskStatusLocked(request.node_id(), task, &follow_ups);
  }
  // A draining attempt's task the worker no longer lists has ended there (the worker forgets a
  // task once it reported it ended, e.g. to a coordinator that restarted since).
  for (const auto& job_id : allocations_.JobsOn(request.node_id())) {
    Allocation* allocation_found = allocations_.Find(job_id);
    if (allocation_found == nullptr) continue;
    Allocation& allocation = *allocation_found;
    if (allocation.phase != Allocation::Phase::kDraining &&
        allocation.phase != Allocation::Phase::kMoving) {
      continue;
    }
    const std::string task_id = TaskId(job_id, allocation.attempt, request.node_id());
    if (!listed.contains(task_id) && !nodes_.StartQueued(request.node_id(), task_id) &&
        !allocation.NodeEnded(request.node_id())) {
      allocation.task_states[request.node_id()] = v1::TASK_STATE_STOPPED;
    }
  }
  nodes_.TakeOrders(request.node_id(), &response);
  return response;
}

absl::Status Cluster::CheckWatcher(const std::string& node_id, const std::string& node_key) {
  if (node_id.empty()) return absl::InvalidArgumentError("node_id: required");
  const std::string key_sha256 = TokenSha256(node_key);
  absl::MutexLock lock(&mu_);
  if (!nodes_.Known(node_id)) {
    return absl::NotFoundError(absl::StrCat("node ", node_id, " is not registered"));
  }
  return nodes_.CheckKey(node_id, key_sha256);
}

void Cluster::OnTaskStatusLocked(const std::string& node_id, const v1::TaskStatus& status,
                                 FollowUps* follow_ups) {
  Allocation* allocation = allocations_.Find(status.job_id());
  if (allocation == nullptr || allocation->attempt != status.attempt()) {
    // A task the coordinator no longer wants (cancelled, failed elsewhere,
    // or from an earlier attempt of the job): stop it.
    if (status.state() == v1::TASK_STATE_STARTING || status.state() == v1::TASK_STATE_RUNNING) {
      nodes_.QueueStop(node_id, status.task_id());
    }
    return;
  }
  allocation->task_states[node_id] = status.state();
  for (const auto& rank : status.ranks()) {
    v1::RankStepTime& time = allocation->rank_times[rank.rank()];
    time = rank;
    if (time.node_id().empty()) time.set_node_id(node_id);
  }
  const std::string job_id = status.job_id();
  if (status.state() == v1::TASK_STATE_FAILED) {
    v1::TrainerFailure failure = status.failure();
    if (failure.node_id().empty()) failure.set_node_id(node_id);
    if (!failure.has_time()) *failure.mutable_time() = ToProto(options_.now());
    AddFailureLocked(job_id, status.attempt(), failure);
    return;
  }
  if (allocation->phase != Allocation::Phase::kRunning) return;
  if (status.state() == v1::TASK_STATE_STOPPED) {
    // Only a move stops a running attempt's task (a cancel or a decision drains it first): one
    // this coordinator ordered before it restarted. The job moves as it would have.
    allocation->phase = Allocation::Phase::kMoving;
    return;
  }
  if (allocation->AllNodesIn(v1::TASK_STATE_SUCCEEDED)) {
    if (!allocation->success_pending) {
      allocation->success_pending = true;
      follow_ups->succeeded.push_back({job_id, SuccessOf(*allocation)});
    }
  } else if (!allocation->running_seen && allocation->AllNodesIn(v1::TASK_STATE_RUNNING)) {
    // Once per allocation: every heartbeat of a running job would otherwise read the store.
    allocation->running_seen = true;
    follow_ups->running.push_back(
        {job_id, allocation->attempt, static_cast<int>(allocation->ranks.size())});
  }
}

void Cluster::FinishFollowUps(const FollowUps& follow_ups) {
  for (const auto& running : follow_ups.running) {
    auto job = store_->GetJob(running.job_id);
    bool done = job.ok();
    if (job.ok() && job->state() == v1::JOB_STATE_SCHEDULED && job->attempt() == running.attempt) {
      auto transitioned =
          jobs_->Transition(running.job_id, v1::JOB_STATE_RUNNING,
                            absl::StrCat("all ", running.ranks, " ranks running"));
      done = transitioned.ok() || absl::IsFailedPrecondition(transitioned.status());
      LogRetried(transitioned.status(), absl::StrCat("job ", running.job_id, " to RUNNING"));
    }
    if (!done) {
      // The next heartbeat tries again.
      absl::MutexLock lock(&mu_);
      Allocation* allocation = allocations_.Find(running.job_id);
      if (allocation != nullptr && allocation->attempt == running.attempt) {
        allocation->running_seen = false;
      }
    }
  }
  for (const auto& [job_id, success] : follow_ups.succeeded) {
    const bool recorded = RecordSuccess(job_id, success);
    absl::MutexLock lock(&mu_);
    Allocation* allocation = allocations_.Find(job_id);
    if (allocation == nullptr || allocation->attempt != success.attempt) continue;
    allocation->success_pending = false;
    // Otherwise a tick records it (a store error) or drains the attempt (a node was lost since).
    if (recorded && allocation->phase == Allocation::Phase::kRunning) allocations_.Erase(job_id);
  }
}

Cluster::SuccessRecord Cluster::SuccessOf(const Allocation& allocation) {
  SuccessRecord record;
  record.attempt = allocation.attempt;
  record.nodes = allocation.Nodes();
  record.world_size = static_cast<int>(allocation.ranks.size());
  record.start_step = allocation.start_step;
  record.placed_time = allocation.placed_time;
  return record;
}

bool Cluster::RecordSuccess(const std::string& job_id, const SuccessRecord& success) {
  auto job = store_->GetJob(job_id);
  if (job.ok() && IsTerminal(job->state())) return true;
  const absl::Time now = options_.now();
  auto succeeded = jobs_->Transition(
      job_id, v1::JOB_STATE_SUCCEEDED, "every rank finished", [&](v1::Job& stored) {
        v1::JobAttempt* record = stored.add_attempts();
        record->set_attempt(success.attempt);
        for (const auto& node : success.nodes) record->add_node_ids(node);
        record->set_world_size(success.world_size);
        *record->mutable_layout() = stored.plan().layout();
        record->set_start_step(success.start_step);
        record->set_end_step(stored.current_step());
        *record->mutable_start_time() = ToProto(success.placed_time);
        *record->mutable_end_time() = ToProto(now);
        record->set_reason("every rank finished");
      });
  if (succeeded.ok() || absl::IsFailedPrecondition(succeeded.status())) return true;
  LogRetried(succeeded.status(), absl::StrCat("job ", job_id, " to SUCCEEDED"));
  return false;
}

absl::StatusOr<v1::ReportResponse> Cluster::Report(const v1::ReportRequest& request) {
  if (request.reports().empty()) return v1::ReportResponse();
  for (const auto& report : request.reports()) {
    if (report.job_id().empty()) return absl::InvalidArgumentError("reports[].job_id: required");
  }
  const int64_t last_sequence = request.first_sequence() + request.reports_size() - 1;
  // Reports of this batch already stored (the worker resends a batch whose response it lost):
  // skipped, so each report is stored, and each event appended, once.
  int64_t skip = 0;
  const std::string key_sha256 = TokenSha256(request.node_key());
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(nodes_.CheckKey(request.node_id(), key_sha256));
    // A node speaks only for the attempts placed on it.
    for (const auto& report : request.reports()) {
      const Allocation* placed = allocations_.Find(report.job_id());
      if (placed == nullptr || placed->attempt != report.attempt()) continue;
      const auto nodes = placed->Nodes();
      if (std::find(nodes.begin(), nodes.end(), request.node_id()) == nodes.end()) {
        return absl::PermissionDeniedError(
            absl::StrCat("node ", request.node_id(), " reports for ", report.job_id(),
                         " attempt ", report.attempt(), ", which does not run there"));
      }
    }
    const v1::TrainerReport& first = request.reports(0);
    Allocation* allocation = allocations_.Find(first.job_id());
    if (allocation != nullptr && allocation->attempt == first.attempt()) {
      const int64_t acked = allocation->acked_sequence[request.node_id()];
      skip = std::clamp<int64_t>(acked - request.first_sequence() + 1, 0, request.reports_size());
    }
  }
  std::map<std::string, std::vector<v1::StepMetrics>> metrics;
  std::map<std::string, std::vector<v1::EvalMetrics>> evals;
  std::map<std::string, std::vector<v1::Checkpoint>> checkpoints;
  for (int i = static_cast<int>(skip); i < request.reports_size(); ++i) {
    const v1::TrainerReport& report = request.reports(i);
    const std::string& job_id = report.job_id();
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
        if (report.rank() == 0 && job.ok() && job->state() == v1::JOB_STATE_SCHEDULED &&
            job->attempt() == report.attempt()) {
          auto running = jobs_->Transition(
              job_id, v1::JOB_STATE_RUNNING,
              absl::StrCat("all ", job->placements_size(), " ranks of attempt ", report.attempt(),
                           " joined; training from step ", report.started().start_step()));
          LogRetried(running.status(), absl::StrCat("job ", job_id, " to RUNNING"));
        }
        break;
      }
      case v1::TrainerReport::kFailure: {
        absl::MutexLock lock(&mu_);
        v1::TrainerFailure failure = report.failure();
        if (failure.node_id().empty()) failure.set_node_id(request.node_id());
        if (!failure.has_time()) *failure.mutable_time() = report.time();
        AddFailureLocked(job_id, report.attempt(), failure);
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
  {
    absl::MutexLock lock(&mu_);
    const v1::TrainerReport& first = request.reports(0);
    Allocation* allocation = allocations_.Find(first.job_id());
    if (allocation != nullptr && allocation->attempt == first.attempt()) {
      int64_t& acked = allocation->acked_sequence[request.node_id()];
      acked = std::max(acked, last_sequence);
    }
  }
  v1::ReportResponse response;
  response.set_acked_sequence(last_sequence);
  return response;
}

void Cluster::AddFailureLocked(const std::string& job_id, int32_t attempt,
                               const v1::TrainerFailure& failure) {
  Allocation* allocation = allocations_.Find(job_id);
  if (allocation == nullptr || allocation->attempt != attempt) return;  // an earlier attempt's
  allocation->AddFailure(failure, options_.now());
  if (allocation->phase == Allocation::Phase::kRunning) {
    allocation->phase = Allocation::Phase::kFailing;
  }
}

void Cluster::DecideLocked(const std::string& job_id, Allocation& allocation, absl::Time now) {
  if (allocation.phase != Allocation::Phase::kFailing) return;
  const bool cause_known = std::any_of(allocation.failures.begin(), allocation.failures.end(),
                                       [](const auto& f) { return !IsConsequence(f); });
  const absl::Duration waited = now - allocation.first_failure_time;
  if (!allocation.AllNodesEnded() && waited < options_.failure_settle &&
      !(cause_known && waited >= options_.blame_grace)) {
    return;
  }
  std::optional<v1::Job> job = JobToEndLocked(job_id, allocation, "to settle its failure");
  if (!job) return;
  const size_t blamed = BlameIndex(allocation.failures);
  v1::TrainerFailure primary = allocation.failures[blamed];
  if (primary.step() == 0) {
    auto rank = allocation.rank_times.find(primary.rank());
    primary.set_step(rank != allocation.rank_times.end() ? rank->second.step()
                                                         : job->current_step());
  }
  const std::string description = DescribeFailure(primary);
  const int32_t max_restarts = job->spec().max_restarts();
  const bool retry = IsRetryable(primary.kind()) && job->restarts() < max_restarts;
  const int64_t resume_step =
      ResumesFromCheckpoints(job->spec()) ? job->latest_checkpoint().step() : 0;
  std::string reason;
  if (retry) {
    reason =
        absl::StrCat("attempt ", allocation.attempt, " failed: ", description, "; restarting from ",
                     resume_step > 0 ? absl::StrCat("the checkpoint of step ", resume_step)
                                     : std::string("the start"),
                     " (restart ", job->restarts() + 1, " of ", max_restarts, ")");
  } else if (!IsRetryable(primary.kind())) {
    reason = absl::StrCat(description, " (not retried: the same spec and data fail again)");
  } else if (max_restarts > 0) {
    reason = absl::StrCat(description, " (no restarts left: ", max_restarts, " used)");
  } else {
    reason = description;
  }
  v1::JobAttempt record = EndedAttempt(allocation, *job, now, description);
  *record.mutable_failure() = primary;
  std::vector<v1::JobEvent> events;
  *events.emplace_back().mutable_failure() = primary;
  for (size_t i = 0; i < allocation.failures.size(); ++i) {
    if (i == blamed) continue;
    *record.add_consequences() = allocation.failures[i];
    *events.emplace_back().mutable_failure() = allocation.failures[i];
  }
  auto transitioned = jobs_->Transition(
      job_id, retry ? v1::JOB_STATE_RESTARTING : v1::JOB_STATE_FAILED, reason,
      [&](v1::Job& stored) {
        *stored.mutable_failure() = primary;
        *stored.add_attempts() = record;
        if (!retry) return;
        stored.set_restarts(stored.restarts() + 1);
        stored.set_attempt(stored.attempt() + 1);
        stored.mutable_placements()->Clear();
        // Steps after the checkpoint are trained again: their metrics (and events) are those of
        // the new attempt.
        stored.set_current_step(resume_step);
      },
      events);
  if (!transitioned.ok() && !absl::IsFailedPrecondition(transitioned.status())) {
    LogRetried(transitioned.status(),
               absl::StrCat("ending attempt ", allocation.attempt, " of job ", job_id));
    return;
  }
  if (transitioned.ok()) ++(retry ? restarts_ : failures_)[primary.kind()];
  DrainLocked(job_id, allocation);
}

std::optional<v1::Job> Cluster::JobToEndLocked(const std::string& job_id, Allocation& allocation,
                                               const char* why) {
  absl::StatusOr<v1::Job> job = store_->GetJob(job_id);
  if (!job.ok()) {
    LogRetried(job.status(), absl::StrCat("reading job ", job_id, " ", why));
    return std::nullopt;
  }
  if (IsTerminal(job->state())) {  // cancelled meanwhile
    DrainLocked(job_id, allocation);
    return std::nullopt;
  }
  return *std::move(job);
}

void Cluster::SettleMoveLocked(const std::string& job_id, Allocation& allocation,
                               absl::Time now) {
  if (allocation.phase != Allocation::Phase::kMoving) return;
  if (allocation.AllNodesIn(v1::TASK_STATE_SUCCEEDED)) {
    // It finished before it could move: recorded as a success.
    allocation.phase = Allocation::Phase::kRunning;
    return;
  }
  if (!allocation.AllNodesEnded()) return;
  std::optional<v1::Job> job = JobToEndLocked(job_id, allocation, "to queue it again");
  if (!job) return;
  const int64_t resume_step =
      ResumesFromCheckpoints(job->spec()) ? job->latest_checkpoint().step() : 0;
  const std::string description = absl::StrCat(
      allocation.moving_off.empty() ? std::string("a node was drained")
                                    : absl::StrCat("node ", allocation.moving_off, " drained"),
      ": attempt ", allocation.attempt, " saved a checkpoint and stopped");
  v1::JobAttempt record = EndedAttempt(allocation, *job, now, description);
  auto transitioned = jobs_->Transition(
      job_id, v1::JOB_STATE_RESTARTING,
      absl::StrCat(description, "; placed again from ",
                   resume_step > 0 ? absl::StrCat("the checkpoint of step ", resume_step)
                                   : std::string("the start"),
                   " (no restart counted)"),
      [&](v1::Job& stored) {
        *stored.add_attempts() = record;
        stored.set_attempt(stored.attempt() + 1);
        stored.mutable_placements()->Clear();
        stored.set_current_step(resume_step);
      });
  if (!transitioned.ok() && !absl::IsFailedPrecondition(transitioned.status())) {
    LogRetried(transitioned.status(),
               absl::StrCat("queueing job ", job_id, " again after its move"));
    return;
  }
  DrainLocked(job_id, allocation);
}

void Cluster::DrainLocked(const std::string& job_id, Allocation& allocation) {
  allocation.phase = Allocation::Phase::kDraining;
  for (const auto& node : allocation.Nodes()) {
    if (allocation.NodeEnded(node)) continue;
    const std::string task_id = TaskId(job_id, allocation.attempt, node);
    if (nodes_.WithdrawStart(node, task_id)) {
      allocation.task_states[node] = v1::TASK_STATE_STOPPED;  // never started
    } else {
      nodes_.QueueStop(node, task_id);
    }
  }
}

std::vector<NodeCapacity> Cluster::CapacityLocked() { return nodes_.Capacity(allocations_.Used()); }

void Cluster::ExpireNodesLocked(absl::Time now) {
  for (const auto& [node_id, silence] : nodes_.Expire(now)) {
    const std::string reason = absl::StrCat("no heartbeat for ", absl::FormatDuration(silence));
    for (const auto& job_id : allocations_.JobsOn(node_id)) {
      Allocation& allocation = *allocations_.Find(job_id);
      allocation.lost_nodes.insert(node_id);
      if (allocation.phase == Allocation::Phase::kDraining) continue;
      v1::TrainerFailure failure;
      failure.set_kind(v1::FAILURE_KIND_NODE_LOST);
      failure.set_rank(-1);
      failure.set_node_id(node_id);
      failure.set_message(reason);
      *failure.mutable_time() = ToProto(now);
      AddFailureLocked(job_id, allocation.attempt, failure);
    }
  }
}

int64_t Cluster::StartStep(const v1::Job& job, const v1::JobSpec& spec) {
  return ResumesFromCheckpoints(spec) ? job.latest_checkpoint().step() : 0;
}

std::string Cluster::PlacementReason(const v1::Job& job, const v1::JobSpec& spec,
                                     const GangPlacement& placement, const v1::LayoutPlan& plan) {
  std::vector<std::string> node_order;
  for (const auto& rank : placement.ranks) {
    if (std::find(node_order.begin(), node_order.end(), rank.node_id()) == node_order.end()) {
      node_order.push_back(rank.node_id());
    }
  }
  std::string reason = absl::StrCat("placed on ", absl::StrJoin(node_order, ", "));
  if (job.attempt() > 0) {
    const int64_t start_step = StartStep(job, spec);
    reason = absl::StrCat("attempt ", job.attempt(), " ", reason, ", resuming from ",
                          start_step > 0 ? absl::StrCat("the checkpoint of step ", start_step)
                                         : std::string("the start"));
    if (static_cast<int>(placement.ranks.size()) != RequestedDevices(job.spec())) {
      absl::StrAppend(&reason, "; re-planned for ", placement.ranks.size(), " of the ",
                      RequestedDevices(job.spec()), " devices asked for (",
                      plan.explanation().substr(0, plan.explanation().find('.')), ")");
    }
  }
  return reason;
}

int Cluster::AdmitLocked(const v1::Job& job, const v1::JobSpec& spec,
                         const GangPlacement& placement,
                         std::map<std::string, v1::TaskAssignment> assignments) {
  Allocation allocation;
  allocation.attempt = job.attempt();
  allocation.ranks = placement.ranks;
  allocation.master_node = placement.ranks.front().node_id();
  allocation.master_port = allocations_.FreeMasterPort(
      allocation.master_node, options_.base_master_port, /*avoid=*/job.master_port());
  const int master_port = allocation.master_port;
  allocation.placed_time = options_.now();
  allocation.start_step = StartStep(job, spec);
  allocation.storing = true;
  for (auto& [node_id, assignment] : assignments) {
    for (v1::TrainerTask& task : *assignment.mutable_trainers()) {
      task.mutable_assignment()->set_master_port(master_port);
    }
    nodes_.QueueStart(node_id, std::move(assignment), /*held=*/true);
  }
  allocations_.Add(job.job_id(), std::move(allocation));
  return master_port;
}

std::map<std::string, v1::TaskAssignment> Cluster::Assignments(const v1::Job& job,
                                                               const v1::JobSpec& spec,
                                                               const GangPlacement& placement,
                                                               const v1::LayoutPlan& plan) const {
  std::map<std::string, int> local_world;
  for (const auto& rank : placement.ranks) ++local_world[rank.node_id()];
  const std::string checkpoint_dir = spec.checkpoint().directory().empty()
                                         ? absl::StrCat(options_.checkpoint_root, "/", job.job_id())
                                         : spec.checkpoint().directory();
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const auto& rank : placement.ranks) {
    v1::TaskAssignment& assignment = assignments[rank.node_id()];
    assignment.set_task_id(TaskId(job.job_id(), job.attempt(), rank.node_id()));
    v1::TrainerTask* task = assignment.add_trainers();
    task->set_job_id(job.job_id());
    task->set_attempt(job.attempt());
    *task->mutable_spec() = spec;
    *task->mutable_plan() = plan;
    task->set_checkpoint_directory(checkpoint_dir);
    v1::RankAssignment* ra = task->mutable_assignment();
    ra->set_rank(rank.rank());
    ra->set_world_size(static_cast<int>(placement.ranks.size()));
    ra->set_local_rank(rank.local_rank());
    ra->set_local_world_size(local_world[rank.node_id()]);
    ra->set_master_addr(placement.master_addr);
    ra->set_device_type(rank.gpu_index() >= 0 ? v1::DEVICE_TYPE_CUDA : v1::DEVICE_TYPE_CPU);
    ra->set_gpu_index(rank.gpu_index());
  }
  return assignments;
}

const absl::StatusOr<v1::LayoutPlan>& Cluster::CachedPlan(
    const v1::Job& job, const v1::JobSpec& spec,
    const absl::StatusOr<planner::DeviceTarget>& target) {
  // A job's spec never changes, so its plan changes only with the device it is planned for (or
  // the devices it is given after losing some).
  const std::string fingerprint =
      target.ok() ? absl::StrCat(target->device.SerializeAsString(), "|", target->devices_per_node,
                                 "|", target->gpu_name, "|", RequestedDevices(spec))
                  : target.status().ToString();
  PlanEntry& cached = plan_cache_[job.job_id()];
  if (!cached.plan.has_value() || cached.fingerprint != fingerprint) {
    cached.fingerprint = fingerprint;
    cached.plan = PlanForTarget(spec, target);
  }
  return *cached.plan;
}

Cluster::PassSnapshot Cluster::SnapshotLocked(const std::vector<v1::Job>& waiting) {
  PassSnapshot snapshot;
  for (const auto& job : waiting) {
    // A restarting job is listed while its failed attempt still drains.
    if (allocations_.Find(job.job_id()) == nullptr) {
      snapshot.waiting.insert(job.job_id());
    }
  }
  if (snapshot.waiting.empty()) return snapshot;
  snapshot.summaries = nodes_.Summaries();
  snapshot.used = allocations_.Used();
  snapshot.generation = nodes_.generation();
  return snapshot;
}

Cluster::PassWrites Cluster::SchedulePass(const std::vector<v1::Job>& active,
                                          const PassSnapshot& snapshot, ClusterStats* stats,
                                          std::set<std::string>* admitted_ids) {
  // `active` holds the waiting jobs (ListWaitingJobs).
  std::vector<GangRequest> requests;
  std::map<std::string, const v1::Job*> waiting;
  // The spec and plan each waiting job starts with, fitted to the devices registered now.
  std::map<std::string, v1::JobSpec> specs;
  std::map<std::string, v1::LayoutPlan> plans;
  std::map<std::string, std::string> unfit;
  const std::set<std::string>& waiting_ids = snapshot.waiting;
  if (waiting_ids.empty()) {
    plan_cache_.clear();
    return {};
  }
  PhaseTimer phase(stats);
  std::vector<NodeCapacity> capacity = NodeRegistry::Subtract(*snapshot.summaries, snapshot.used);
  // Jobs asking for the same kind of device share one look over the nodes.
  std::map<std::string, absl::StatusOr<planner::DeviceTarget>> targets;
  for (const auto& job : active) {
    if (!waiting_ids.contains(job.job_id())) continue;
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
    // A restarting job with an automatic layout that lost devices (a node is gone) runs on what
    // is free rather than waiting for the node: fewer data-parallel replicas, the same global
    // batch through more accumulation. Its checkpoint is resharded on load.
    v1::JobSpec& spec = specs[job.job_id()] = job.spec();
    if (job.state() == v1::JOB_STATE_RESTARTING && AutomaticLayout(spec)) {
      int free = 0;
      for (const auto& node : capacity) {
        if (!node.schedulable) continue;
        if (!Unsatisfiable(request, {node}).has_value()) {
          free += request.use_gpus ? static_cast<int>(node.free_gpus.size()) : node.free_cpu_slots;
        }
      }
      const int asked = RequestedDevices(spec);
      for (int devices = std::min(free, asked); devices >= 1 && devices < asked; --devices) {
        const v1::JobSpec smaller = WithDevices(job.spec(), devices);
        if (auto plan = PlanForTarget(smaller, target->second); plan.ok() && plan->fits()) {
          spec = smaller;
          break;
        }
      }
    }
    // Automatic layouts are chosen for the devices the job would get; explicit ones are checked
    // against them. A job that cannot be planned here (no matching node yet, a GPU without a
    // device model) keeps its provisional plan and the scheduler says why it waits.
    v1::LayoutPlan& plan = plans[job.job_id()];
    plan = job.plan();
    const absl::StatusOr<v1::LayoutPlan>& fitted = CachedPlan(job, spec, target->second);
    if (fitted.ok()) {
      if (!fitted->fits()) {
        unfit[job.job_id()] = fitted->explanation();
        continue;
      }
      plan = *fitted;
    }
    waiting[job.job_id()] = &job;
    request.world_size = std::max(1, plan.world_size());
    request.tensor_parallel = std::max(1, plan.layout().tensor_parallel());
    requests.push_back(std::move(request));
  }
  // Plans of jobs that left the queue are not needed again.
  std::erase_if(plan_cache_, [&](const auto& entry) { return !waiting_ids.contains(entry.first); });
  phase.Next("plan");
  ScheduleResult result;
  if (!requests.empty()) result = Schedule(std::move(requests), std::move(capacity));
  phase.Next("schedule");
  // The gangs are admitted (allocation made) under one short hold, unless a node registered again
  // (or was lost) since the snapshot: it may offer other devices now, and that gang waits for the
  // next pass. Only a pass adds or frees allocations, so the other gangs' devices are still free.
  // Their assignments are queued held back: they go out to their nodes only once the placements
  // are stored, so that no worker starts a task the store does not know, and no heartbeat waits
  // for the store (it leaves without them).
  std::vector<const GangPlacement*> admitted;
  std::map<std::string, int> master_ports;  // of the admitted placements, by job
  // Each placement's assignments (the spec and plan copied for every node) are made before the
  // hold; only the master port is filled in under it.
  std::vector<std::map<std::string, v1::TaskAssignment>> assignments;
  assignments.reserve(result.placed.size());
  for (const auto& placement : result.placed) {
    const std::string& job_id = placement.job_id;
    assignments.push_back(Assignments(*waiting[job_id], specs[job_id], placement, plans[job_id]));
  }
  {
    TimedLock lock(&mu_, stats);
    for (size_t i = 0; i < result.placed.size(); ++i) {
      const GangPlacement& placement = result.placed[i];
      bool stale = false;
      for (const auto& rank : placement.ranks) {
        stale = stale || nodes_.ChangedSince(rank.node_id(), snapshot.generation);
      }
      if (stale || allocations_.Find(placement.job_id) != nullptr) continue;
      master_ports[placement.job_id] =
          AdmitLocked(*waiting[placement.job_id], specs[placement.job_id], placement,
                      std::move(assignments[i]));
      admitted.push_back(&placement);
      admitted_ids->insert(placement.job_id);
    }
  }
  phase.Next("admit");
  // Every placement and every changed pending reason of the pass is stored in one transaction
  // (one fsync), without mu_. Each write owns what it stores: under Start() it is stored beside
  // the next pass.
  PassWrites pass;
  for (const GangPlacement* placement : admitted) {
    const std::string& job_id = placement->job_id;
    pass.writes.push_back(
        {job_id, v1::JOB_STATE_SCHEDULED,
         PlacementReason(*waiting[job_id], specs[job_id], *placement, plans[job_id]),
         [plan = std::move(plans[job_id]), ranks = placement->ranks,
          port = master_ports[job_id]](v1::Job& stored) {
           *stored.mutable_plan() = plan;
           stored.mutable_placements()->Clear();
           for (const auto& rank : ranks) *stored.add_placements() = rank;
           stored.set_master_port(port);
         }});
  }
  pass.placements = pass.writes.size();
  result.pending_reasons.merge(unfit);
  std::map<std::string, const v1::Job*> by_id;
  for (const auto& job : active) by_id[job.job_id()] = &job;
  for (const auto& [job_id, reason] : result.pending_reasons) {
    const v1::Job* job = by_id[job_id];
    if (job == nullptr) continue;
    // A restarting job keeps its state (and the reason it restarts) until it is placed again.
    if (job->state() == v1::JOB_STATE_PENDING && job->reason() != reason) {
      pass.writes.push_back({job_id, v1::JOB_STATE_PENDING, reason, nullptr});
    }
  }
  phase.Next("store");
  return pass;
}

std::set<std::string> Cluster::StorePass(PassWrites pass) {
  std::set<std::string> placed;
  if (pass.writes.empty()) return placed;
  const std::vector<absl::StatusOr<v1::Job>> stored = jobs_->TransitionAll(pass.writes);
  std::function<void(double)> latency_observer;
  std::vector<double> latencies;
  {
    absl::MutexLock lock(&mu_);
    latency_observer = latency_observer_;
    for (size_t i = 0; i < pass.placements; ++i) {
      const std::string& job_id = pass.writes[i].job_id;
      Allocation* allocation = allocations_.Find(job_id);
      if (allocation != nullptr) allocation->storing = false;
      if (stored[i].ok()) {
        if (allocation != nullptr) {
          for (const auto& node : allocation->Nodes()) {
            nodes_.ReleaseStart(node, TaskId(job_id, allocation->attempt, node));
          }
        }
        placed.insert(job_id);
        if (stored[i]->attempt() == 0) {
          latencies.push_back(absl::ToDoubleSeconds(
              options_.now() -
              absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(stored[i]->create_time()))));
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
          nodes_.WithdrawStart(node, TaskId(job_id, allocation->attempt, node));
        }
        allocations_.Erase(job_id);
      }
    }
  }
  if (latency_observer) {
    for (double seconds : latencies) latency_observer(seconds);
  }
  for (size_t i = pass.placements; i < pass.writes.size(); ++i) {
    if (!stored[i].ok() && !absl::IsFailedPrecondition(stored[i].status())) {
      LogRetried(stored[i].status(),
                 absl::StrCat("recording why job ", pass.writes[i].job_id, " waits"));
    }
  }
  return placed;
}

void Cluster::HandOver(PassWrites pass) {
  absl::MutexLock lock(&store_mu_);
  store_mu_.Await(absl::Condition(
      +[](Cluster* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->store_mu_) {
        return !self->store_next_.has_value() && !self->store_busy_;
      },
      this));
  store_next_ = std::move(pass);
}

void Cluster::StoreLoop() {
  while (true) {
    PassWrites pass;
    {
      absl::MutexLock lock(&store_mu_);
      store_mu_.Await(absl::Condition(
          +[](Cluster* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->store_mu_) {
            return self->store_next_.has_value() || self->store_stopping_;
          },
          this));
      // Writes handed over before Stop are stored first.
      if (!store_next_.has_value()) return;
      pass = std::move(*store_next_);
      store_next_.reset();
      store_busy_ = true;
    }
    const auto start = std::chrono::steady_clock::now();
    StorePass(std::move(pass));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    absl::MutexLock lock(&store_mu_);
    store_busy_ = false;
    store_overlapped_seconds_ += seconds;
  }
}

ClusterStats Cluster::Tick(bool count) { return RunPass(count, /*overlap_store=*/false); }

ClusterStats Cluster::RunPass(bool count, bool overlap_store) {
  absl::MutexLock pass_lock(&pass_mu_);
  const absl::Time now = options_.now();
  ClusterStats stats;
  stats.counted = count;
  PhaseTimer phase(&stats);
  // Read without mu_. Only the waiting jobs are parsed: parsing every running job's blob cost
  // more than the rest of a pass on a busy cluster. Allocations are added only by a pass, so
  // every allocation's job is listed unless it ended since; a job cancelled or finished meanwhile
  // is seen by the next pass.
  absl::StatusOr<std::vector<Store::JobSummary>> active = store_->ListActiveJobSummaries();
  absl::StatusOr<std::vector<v1::Job>> waiting = store_->ListWaitingJobs();
  // Looked up once per allocation under mu_: built before taking it.
  absl::flat_hash_set<std::string_view> active_ids;
  if (active.ok()) {
    active_ids.reserve(active->size());
    for (const auto& job : *active) active_ids.insert(job.job_id);
  }
  phase.Next("list");
  PassSnapshot snapshot;
  bool relist = false;
  {
    TimedLock lock(&mu_, &stats);
    LogRetried(nodes_.Flush(), "writing node records");
    // Liveness is a scan of every node: the regular passes (every tick_interval) do it.
    if (count) ExpireNodesLocked(now);
    if (active.ok()) {
      for (auto& [job_id, allocation] : allocations_.all()) {
        // Placed by the previous pass and not yet stored (its job may still be listed PENDING, or
        // already cancelled): the store thread releases or takes it back first.
        if (allocation.storing) continue;
        if (!active_ids.contains(job_id)) {
          // Cancelled (or ended by a decision already recorded): stop what still runs.
          if (allocation.phase != Allocation::Phase::kDraining) DrainLocked(job_id, allocation);
          continue;
        }
        DecideLocked(job_id, allocation, now);
        SettleMoveLocked(job_id, allocation, now);
        // A success whose recording failed earlier is recorded now (unless a heartbeat is
        // recording it).
        if (allocation.phase == Allocation::Phase::kRunning && !allocation.success_pending &&
            allocation.AllNodesIn(v1::TASK_STATE_SUCCEEDED) &&
            RecordSuccess(job_id, SuccessOf(allocation))) {
          allocation.phase = Allocation::Phase::kDraining;
        }
      }
      // Attempts whose every task has ended give their devices back. A job still active whose
      // attempt just ended (it restarts) may be placed again in this pass: list again for it.
      allocations_.EraseIf([&](const std::string& job_id, const Allocation& allocation) {
        const bool ended = allocation.phase == Allocation::Phase::kDraining &&
                           allocation.AllNodesEnded() && !allocation.success_pending;
        relist = relist || (ended && active_ids.contains(job_id));
        return ended;
      });
      if (!relist && waiting.ok()) snapshot = SnapshotLocked(*waiting);
    }
  }
  phase.Next("settle");
  if (relist) {
    active_ids.clear();  // views into the listing replaced here
    active = store_->ListActiveJobSummaries();
    waiting = store_->ListWaitingJobs();
    phase.Next("list");
    if (waiting.ok()) {
      TimedLock lock(&mu_, &stats);
      snapshot = SnapshotLocked(*waiting);
    }
    phase.Next("settle");
  }
  if (active.ok() && waiting.ok()) {
    std::set<std::string> placed;
    PassWrites pass = SchedulePass(*waiting, snapshot, &stats, &placed);
    phase = PhaseTimer(&stats);
    if (overlap_store) {
      // Counted as placed: the store thread takes a placement back only if its job was cancelled
      // meanwhile (or on a store error), which the next pass's counts show.
      if (!pass.writes.empty()) HandOver(std::move(pass));
    } else {
      placed = StorePass(std::move(pass));
    }
    phase.Next("store");
    {
      absl::MutexLock lock(&store_mu_);
      if (store_overlapped_seconds_ > 0) {
        stats.phase_seconds["store_overlapped"] += store_overlapped_seconds_;
        store_overlapped_seconds_ = 0;
      }
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
    TimedLock lock(&mu_, &stats);
    // Counted in place: copying every node record (or capacity) here cost more than the pass.
    NodeRegistry::Tally tally = nodes_.Count(allocations_.Used());
    stats.nodes = std::move(tally.nodes);
    stats.gpus_total = tally.gpus_total;
    stats.gpus_allocated = tally.gpus_allocated;
    stats.cpu_slots_total = tally.cpu_slots_total;
    stats.cpu_slots_allocated = tally.cpu_slots_allocated;
    stats.restarts = restarts_;
    stats.failures = failures_;
    for (auto& [job_id, allocation] : allocations_.all()) {
      if (allocation.phase != Allocation::Phase::kRunning || allocation.rank_times.empty()) {
        continue;
      }
      std::vector<v1::RankStepTime> ranks;
      for (const auto& [rank, time] : allocation.rank_times) ranks.push_back(time);
      stats.stragglers[job_id] = ComputeStraggler(std::move(ranks), options_.straggler_threshold);
    }
  }
  // Ended jobs are counted by the store (the active ones above, as this pass left them).
  if (auto ended = store_->CountEndedJobs(); ended.ok()) {
    for (const auto& [state, count] : *ended) stats.jobs[state] = count;
  } else {
    LogRetried(ended.status(), "counting ended jobs");
  }
  phase.Next("count");
  return stats;
}

std::optional<v1::StragglerReport> Cluster::Straggler(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  Allocation* allocation = allocations_.Find(job_id);
  if (allocation == nullptr || allocation->rank_times.empty()) return std::nullopt;
  std::vector<v1::RankStepTime> ranks;
  for (const auto& [rank, time] : allocation->rank_times) ranks.push_back(time);
  return ComputeStraggler(std::move(ranks), options_.straggler_threshold);
}

std::vector<NodeCapacity> Cluster::Capacity() {
  absl::MutexLock lock(&mu_);
  return CapacityLocked();
}

std::vector<v1::Node> Cluster::Nodes(bool include_lost) {
  absl::MutexLock lock(&mu_);
  std::map<std::string, std::set<std::string>> jobs_on;
  for (const auto& [job_id, allocation] : allocations_.all()) {
    for (const auto& rank : allocation.ranks) jobs_on[rank.node_id()].insert(job_id);
  }
  std::vector<v1::Node> nodes;
  for (const auto& capacity : CapacityLocked()) {
    const v1::Node* stored = nodes_.Find(capacity.node_id);
    if (stored == nullptr) continue;
    if (stored->state() == v1::NODE_STATE_LOST && !include_lost) continue;
    v1::Node node = *stored;
    for (int gpu : capacity.free_gpus) node.add_free_gpus(gpu);
    node.set_free_cpu_slots(capacity.free_cpu_slots);
    for (const auto& job_id : jobs_on[capacity.node_id]) node.add_job_ids(job_id);
    nodes.push_back(std::move(node));
  }
  return nodes;
}

v1::Node Cluster::NodeViewLocked(const v1::Node& stored) {
  v1::Node node = stored;
  for (const NodeCapacity& capacity : CapacityLocked()) {
    if (capacity.node_id != node.node_id()) continue;
    for (int gpu : capacity.free_gpus) node.add_free_gpus(gpu);
    node.set_free_cpu_slots(capacity.free_cpu_slots);
  }
  for (const auto& job_id : allocations_.JobsOn(node.node_id())) node.add_job_ids(job_id);
  node.clear_key_sha256();
  return node;
}

absl::StatusOr<v1::DrainNodeResponse> Cluster::DrainNode(const std::string& node_id,
                                                         bool checkpoint,
                                                         const std::string& reason) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(nodes_.SetDrained(node_id, true, reason, options_.now()));
  v1::DrainNodeResponse response;
  for (const auto& job_id : allocations_.JobsOn(node_id)) {
    Allocation& allocation = *allocations_.Find(job_id);
    // Only an attempt that runs as placed moves; one being stored, decided or stopped ends on its
    // own (a failing one restarts elsewhere: the drained node takes no placement).
    if (!checkpoint || allocation.storing || allocation.success_pending ||
        allocation.phase != Allocation::Phase::kRunning) {
      if (allocation.phase != Allocation::Phase::kDraining) response.add_remaining_job_ids(job_id);
      continue;
    }
    allocation.phase = Allocation::Phase::kMoving;
    allocation.moving_off = node_id;
    for (const auto& node : allocation.Nodes()) {
      if (allocation.NodeEnded(node)) continue;
      const std::string task_id = TaskId(job_id, allocation.attempt, node);
      if (nodes_.WithdrawStart(node, task_id)) {
        allocation.task_states[node] = v1::TASK_STATE_STOPPED;  // never started
      } else {
        nodes_.QueueCheckpointAndStop(node, task_id);
      }
    }
    response.add_moving_job_ids(job_id);
  }
  *response.mutable_node() = NodeViewLocked(*nodes_.Find(node_id));
  return response;
}

absl::StatusOr<v1::Node> Cluster::UndrainNode(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(nodes_.SetDrained(node_id, false, "", options_.now()));
  return NodeViewLocked(*nodes_.Find(node_id));
}

absl::Status Cluster::RemoveNode(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  if (!nodes_.Known(node_id)) {
    return absl::NotFoundError(absl::StrCat("node ", node_id, ": not registered"));
  }
  if (const std::vector<std::string> jobs = allocations_.JobsOn(node_id); !jobs.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", node_id, " still holds devices of job(s) ", absl::StrJoin(jobs, ", "),
                     ": wait until they end or move (drain with checkpoint)"));
  }
  return nodes_.Remove(node_id);
}

void Cluster::Start(std::function<void(const ClusterStats&, double)> observer) {
  store_loop_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "pass-store");
    StoreLoop();
  });
  loop_ = std::thread([this, observer = std::move(observer)] {
    // Named for profiles (perf, top -H): the pass is one thread.
    pthread_setname_np(pthread_self(), "scheduler");
    absl::Time last_start = absl::Now();
    absl::Time last_counted = last_start;
    while (true) {
      {
        absl::MutexLock lock(&wake_mu_);
        // The regular pass comes tick_interval after the previous one started; a requested one
        // as soon as min_tick_gap has passed since then.
        while (!stopping_) {
          const absl::Time wake_now = absl::Now();
          absl::Time due = last_start + options_.tick_interval;
          if (pass_requested_) due = std::min(due, last_start + options_.min_tick_gap);
          if (wake_now >= due) break;
          wake_cv_.WaitWithDeadline(&wake_mu_, due);
        }
        if (stopping_) return;
        pass_requested_ = false;
      }
      last_start = absl::Now();
      // The cluster-wide counts are taken every tick_interval, not on every early pass.
      const bool count = last_start - last_counted >= options_.tick_interval;
      if (count) last_counted = last_start;
      auto start = std::chrono::steady_clock::now();
      ClusterStats stats = RunPass(count, /*overlap_store=*/true);
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (observer) observer(stats, seconds);
    }
  });
}

void Cluster::RequestPass() {
  absl::MutexLock lock(&wake_mu_);
  if (pass_requested_) return;
  pass_requested_ = true;
  wake_cv_.Signal();
}

void Cluster::Stop() {
  {
    absl::MutexLock lock(&wake_mu_);
    stopping_ = true;
    wake_cv_.SignalAll();
  }
  if (loop_.joinable()) loop_.join();
  {
    absl::MutexLock lock(&store_mu_);
    store_stopping_ = true;
  }
  if (store_loop_.joinable()) store_loop_.join();
}

void Cluster::SetAssignmentNotifier(AssignmentNotifier* notifier) {
  absl::MutexLock lock(&mu_);
  notifier_ = notifier;
}

void Cluster::SetFollowUpExecutor(CallExecutor* executor) { follow_up_executor_ = executor; }

void Cluster::SetSchedulingLatencyObserver(std::function<void(double)> observer) {
  absl::MutexLock lock(&mu_);
  latency_observer_ = std::move(observer);
}

}  // namespace tessera::coordinator
