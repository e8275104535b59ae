#include "coordinator/cluster/worker_protocol.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/auth/auth.h"

namespace tessera::coordinator {

absl::StatusOr<v1::RegisterNodeResponse> WorkerProtocol::Register(
    const v1::RegisterNodeRequest& request) {
  if (request.node_id().empty()) return absl::InvalidArgumentError("node_id: required");
  if (request.address().empty()) return absl::InvalidArgumentError("address: required");
  if (request.resources().gpus().empty() && request.resources().cpu_slots() <= 0) {
    return absl::InvalidArgumentError("resources: a node must offer GPUs or cpu_slots");
  }
  bool returning = false;
  RETURN_IF_ERROR(nodes_->Register(request, &returning));
  FollowUps follow_ups;
  {
    GuardedLedger::Hold held(ledger_);
    RegisterLocked(held, request, &follow_ups);
  }
  FinishFollowUps(follow_ups);
  // The node's record is stored with the locks released; a write that fails is retried by the
  // next pass (NodeRegistry::Flush) and reported to the worker, which registers again.
  RETURN_IF_ERROR(nodes_->Flush(request.node_id()));
  v1::RegisterNodeResponse response;
  response.set_node_id(request.node_id());
  response.set_heartbeat_interval_seconds(
      absl::ToDoubleSeconds(state_->options.heartbeat_interval));
  return response;
}

void WorkerProtocol::RegisterLocked(GuardedLedger::Hold& held,
                                    const v1::RegisterNodeRequest& request, FollowUps* follow_ups) {
  const absl::Time now = state_->Now();
  // A worker that registers again without a task it was given has lost it
  // (the worker restarted): that attempt cannot go on.
  std::set<std::string> reported;
  for (const auto& task : request.running_tasks()) reported.insert(task.task_id());
  for (const auto& job_id : held->JobsOn(request.node_id())) {
    Allocation* found = held->Find(job_id);
    if (found == nullptr) continue;
    Allocation& allocation = *found;
    const std::string task_id = TaskId(job_id, allocation.attempt, request.node_id());
    if (state_->orders.StartQueued(request.node_id(), task_id) || reported.contains(task_id))
      continue;
    if (allocation.NodeEnded(request.node_id())) continue;
    allocation.SetTaskState(request.node_id(), v1::TASK_STATE_FAILED);
    if (allocation.phase() == Allocation::Phase::kDraining) continue;
    v1::TrainerFailure failure;
    failure.set_kind(v1::FAILURE_KIND_PROCESS_EXIT);
    failure.set_rank(-1);
    failure.set_node_id(request.node_id());
    failure.set_message("the worker restarted and no longer runs the job's trainers");
    *failure.mutable_time() = ToProto(now);
    fate_->AddFailureLocked(held, job_id, allocation.attempt, failure);
  }
  for (const auto& task : request.running_tasks()) {
    OnTaskStatusLocked(held, request.node_id(), task, follow_ups);
  }
}

absl::StatusOr<v1::HeartbeatResponse> WorkerProtocol::Heartbeat(
    const v1::HeartbeatRequest& request) {
  // Declared first: the store writes the heartbeat decided run after the lock is released, on the
  // follow-up executor when there is one.
  FollowUps follow_ups;
  absl::Cleanup finish = [&] {
    if (follow_ups.empty()) return;
    CallExecutor* executor = follow_up_executor_.load();
    if (executor == nullptr) return FinishFollowUps(follow_ups);
    executor->Schedule([this, follow_ups = std::move(follow_ups)] { FinishFollowUps(follow_ups); });
  };
  // Hashed and copied before the registry's lock: every heartbeat takes it, and the hash was
  // most of a hold. The metrics are copied into this thread's scratch, which Touch swaps with the
  // node's: the scratch then holds the node's previous ones, whose messages the next copy reuses,
  // so a heartbeat allocates nothing for them.
  const std::string key_sha256 = TokenSha256(request.node_key());
  thread_local google::protobuf::RepeatedPtrField<v1::GpuMetrics> gpu_metrics;
  gpu_metrics.CopyFrom(request.gpu_metrics());
  v1::HeartbeatResponse response;
  ASSIGN_OR_RETURN(const bool alive, nodes_->Touch(request.node_id(), key_sha256, &gpu_metrics));
  if (!alive) {
    // Unknown, or declared lost (its work was failed): start over.
    response.set_reregister(true);
    return response;
  }
  GuardedLedger::Hold held(ledger_);
  // What is queued for the node while its heartbeat is answered leaves with the response.
  OrderOutbox::Answering answering(&state_->orders, request.node_id());
  std::set<std::string> listed;
  for (const auto& task : request.tasks()) {
    listed.insert(task.task_id());
    OnTaskStatusLocked(held, request.node_id(), task, &follow_ups);
  }
  // A draining attempt's task the worker no longer lists has ended there (the worker forgets a
  // task once it reported it ended, e.g. to a coordinator that restarted since).
  for (const auto& job_id : held->JobsOn(request.node_id())) {
    Allocation* allocation_found = held->Find(job_id);
    if (allocation_found == nullptr) continue;
    Allocation& allocation = *allocation_found;
    if (allocation.phase() != Allocation::Phase::kDraining &&
        allocation.phase() != Allocation::Phase::kMoving) {
      continue;
    }
    const std::string task_id = TaskId(job_id, allocation.attempt, request.node_id());
    if (!listed.contains(task_id) && !state_->orders.StartQueued(request.node_id(), task_id) &&
        !allocation.NodeEnded(request.node_id())) {
      allocation.SetTaskState(request.node_id(), v1::TASK_STATE_STOPPED);
    }
  }
  state_->orders.TakeOrders(request.node_id(), &response);
  return response;
}

absl::Status WorkerProtocol::CheckWatcher(const std::string& node_id, const std::string& node_key) {
  if (node_id.empty()) return absl::InvalidArgumentError("node_id: required");
  const std::string key_sha256 = TokenSha256(node_key);
  if (!nodes_->Known(node_id)) {
    return absl::NotFoundError(absl::StrCat("node ", node_id, " is not registered"));
  }
  return nodes_->CheckKey(node_id, key_sha256);
}

void WorkerProtocol::OnTaskStatusLocked(GuardedLedger::Hold& held, const std::string& node_id,
                                        const v1::TaskStatus& status, FollowUps* follow_ups) {
  Allocation* allocation = held->Find(status.job_id());
  if (allocation == nullptr || allocation->attempt != status.attempt()) {
    // A task the coordinator no longer wants (cancelled, failed elsewhere,
    // or from an earlier attempt of the job): stop it.
    if (status.state() == v1::TASK_STATE_STARTING || status.state() == v1::TASK_STATE_RUNNING) {
      state_->orders.QueueStop(node_id, status.task_id());
    }
    return;
  }
  allocation->SetTaskState(node_id, status.state());
  for (const auto& rank : status.ranks()) {
    v1::RankStepTime& time = allocation->rank_times[rank.rank()];
    time = rank;
    if (time.node_id().empty()) time.set_node_id(node_id);
  }
  const std::string job_id = status.job_id();
  if (status.state() == v1::TASK_STATE_FAILED) {
    v1::TrainerFailure failure = status.failure();
    if (failure.node_id().empty()) failure.set_node_id(node_id);
    if (!failure.has_time()) *failure.mutable_time() = ToProto(state_->Now());
    fate_->AddFailureLocked(held, job_id, status.attempt(), failure);
    return;
  }
  if (allocation->phase() != Allocation::Phase::kRunning) return;
  if (status.state() == v1::TASK_STATE_STOPPED) {
    // Only a move stops a running attempt's task (a cancel or a decision drains it first): one
    // this coordinator ordered before it restarted. The job moves as it would have.
    fate_->MovedLocked(held, *allocation);
    return;
  }
  if (allocation->AllNodesIn(v1::TASK_STATE_SUCCEEDED)) {
    if (!allocation->success_pending) {
      allocation->success_pending = true;
      follow_ups->succeeded.push_back({job_id, AttemptFate::SuccessOf(*allocation)});
    }
  } else if (!allocation->running_seen && allocation->AllNodesIn(v1::TASK_STATE_RUNNING)) {
    // Once per allocation: every heartbeat of a running job would otherwise read the store.
    allocation->running_seen = true;
    follow_ups->running.push_back(
        {job_id, allocation->attempt, static_cast<int>(allocation->ranks.size())});
  }
}

namespace {

// TransitionIf's precondition: the job is SCHEDULED in `attempt`.
std::function<absl::Status(const v1::Job&)> ScheduledIn(int32_t attempt) {
  return [attempt](const v1::Job& job) {
    if (job.state() == v1::JOB_STATE_SCHEDULED && job.attempt() == attempt) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.job_id(), " is ", v1::JobState_Name(job.state()), " in attempt ",
                     job.attempt(), ", not ", attempt));
  };
}

}  // namespace

void WorkerProtocol::FinishFollowUps(const FollowUps& follow_ups) {
  for (const auto& running : follow_ups.running) {
    // Only the attempt still SCHEDULED moves (FAILED_PRECONDITION otherwise: moved already, or
    // a newer attempt, or ended), checked on the transition's own read under the job's lock.
    auto transitioned =
        jobs_->TransitionIf(running.job_id, ScheduledIn(running.attempt), v1::JOB_STATE_RUNNING,
                            absl::StrCat("all ", running.ranks, " ranks running"));
    const bool done = transitioned.ok() || absl::IsFailedPrecondition(transitioned.status()) ||
                      absl::IsNotFound(transitioned.status());
    if (!done) {
      LogRetried(transitioned.status(), absl::StrCat("job ", running.job_id, " to RUNNING"));
      // The next heartbeat tries again.
      GuardedLedger::Hold held(ledger_);
      Allocation* allocation = held->Find(running.job_id);
      if (allocation != nullptr && allocation->attempt == running.attempt) {
        allocation->running_seen = false;
      }
    }
  }
  for (const auto& [job_id, success] : follow_ups.succeeded) {
    const bool recorded = fate_->RecordSuccess(job_id, success);
    GuardedLedger::Hold held(ledger_);
    Allocation* allocation = held->Find(job_id);
    if (allocation == nullptr || allocation->attempt != success.attempt) continue;
    allocation->success_pending = false;
    // Otherwise a tick records it (a store error) or drains the attempt (a node was lost since).
    if (recorded && allocation->phase() == Allocation::Phase::kRunning) held->Erase(job_id);
  }
}

absl::StatusOr<v1::ReportResponse> WorkerProtocol::Report(const v1::ReportRequest& request) {
  if (request.reports().empty()) return v1::ReportResponse();
  for (const auto& report : request.reports()) {
    if (report.job_id().empty()) return absl::InvalidArgumentError("reports[].job_id: required");
  }
  const int64_t last_sequence = request.first_sequence() + request.reports_size() - 1;
  // Reports of this batch already stored (the worker resends a batch whose response it lost):
  // skipped, so each report is stored, and each event appended, once.
  int64_t skip = 0;
  RETURN_IF_ERROR(nodes_->CheckKey(request.node_id(), TokenSha256(request.node_key())));
  {
    GuardedLedger::Hold held(ledger_);
    // A node speaks only for the attempts placed on it.
    for (const auto& report : request.reports()) {
      const Allocation* placed = held->Find(report.job_id());
      if (placed == nullptr || placed->attempt != report.attempt()) continue;
      const auto nodes = placed->Nodes();
      if (std::find(nodes.begin(), nodes.end(), request.node_id()) == nodes.end()) {
        return absl::PermissionDeniedError(
            absl::StrCat("node ", request.node_id(), " reports for ", report.job_id(), " attempt ",
                         report.attempt(), ", which does not run there"));
      }
    }
    const v1::TrainerReport& first = request.reports(0);
    Allocation* allocation = held->Find(first.job_id());
    if (allocation != nullptr && allocation->attempt == first.attempt()) {
      const int64_t acked = allocation->acked_sequence[request.node_id()];
      skip = std::clamp<int64_t>(acked - request.first_sequence() + 1, 0, request.reports_size());
    }
  }
  // One request carries one task's reports: one attempt of one job.
  std::map<std::string, int32_t> attempts;
  std::map<std::string, std::vector<v1::StepMetrics>> metrics;
  std::map<std::string, std::vector<v1::EvalMetrics>> evals;
  std::map<std::string, std::vector<v1::Checkpoint>> checkpoints;
  // Loss spikes are kept only once this batch's checkpoints are stored: the rollback they let
  // the next pass decide resumes from the newest of them. A batch without checkpoints keeps them
  // before its store writes: rank 0 reports the commit of a checkpoint in flight before the spike,
  // and a task's batches are sent one at a time, so any such commit is stored already, and a slow
  // write (an fsync on a loaded disk) does not keep the rollback waiting for the spike's figures.
  std::vector<const v1::TrainerReport*> spikes;
  for (int i = static_cast<int>(skip); i < request.reports_size(); ++i) {
    const v1::TrainerReport& report = request.reports(i);
    const std::string& job_id = report.job_id();
    attempts.emplace(job_id, report.attempt());
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
        // Rank 0 starts training only after every rank joined the process group: the whole gang
        // runs. Its report moves the attempt, if still SCHEDULED, to RUNNING.
        if (report.rank() != 0) break;
        std::string ranks = "all";
        {
          // Where the ranks really resumed: the newest checkpoint in the directory, which may be
          // past the one the coordinator placed the attempt to resume from (a checkpoint a
          // cut-off attempt committed before the fence rose, its report lost). The attempt's
          // history entry says so.
          GuardedLedger::Hold held(ledger_);
          Allocation* allocation = held->Find(job_id);
          if (allocation != nullptr && allocation->attempt == report.attempt()) {
            allocation->start_step = report.started().start_step();
            ranks = absl::StrCat("all ", allocation->ranks.size());
          }
        }
        auto running = jobs_->TransitionIf(
            job_id, ScheduledIn(report.attempt()), v1::JOB_STATE_RUNNING,
            absl::StrCat(ranks, " ranks of attempt ", report.attempt(),
                         " joined; training from step ", report.started().start_step()));
        if (!absl::IsFailedPrecondition(running.status()) && !absl::IsNotFound(running.status())) {
          LogRetried(running.status(), absl::StrCat("job ", job_id, " to RUNNING"));
        }
        break;
      }
      case v1::TrainerReport::kFailure: {
        GuardedLedger::Hold held(ledger_);
        v1::TrainerFailure failure = report.failure();
        if (failure.node_id().empty()) failure.set_node_id(request.node_id());
        if (!failure.has_time()) *failure.mutable_time() = report.time();
        fate_->AddFailureLocked(held, job_id, report.attempt(), failure);
        break;
      }
      case v1::TrainerReport::kLossSpike:
        spikes.push_back(&report);
        break;
      default:
        break;
    }
  }
  auto keep_spikes = [&] {
    if (spikes.empty()) return;
    GuardedLedger::Hold held(ledger_);
    for (const v1::TrainerReport* spike : spikes) {
      fate_->AddLossSpikeLocked(held, spike->job_id(), spike->attempt(), spike->loss_spike());
    }
    spikes.clear();
  };
  if (checkpoints.empty()) keep_spikes();
  std::set<std::string> job_ids;
  for (const auto& [id, _] : metrics) job_ids.insert(id);
  for (const auto& [id, _] : evals) job_ids.insert(id);
  for (const auto& [id, _] : checkpoints) job_ids.insert(id);
  for (const auto& id : job_ids) {
    RETURN_IF_ERROR(
        jobs_->RecordReports(id, metrics[id], evals[id], checkpoints[id], attempts[id]));
  }
  if (!checkpoints.empty()) {
    // The progress a stop of the attempt would lose now starts at its newest checkpoint.
    GuardedLedger::Hold held(ledger_);
    const absl::Time now = state_->Now();
    for (const auto& [id, committed] : checkpoints) {
      Allocation* allocation = held->Find(id);
      if (allocation == nullptr || allocation->attempt != attempts[id]) continue;
      for (const v1::Checkpoint& checkpoint : committed) {
        allocation->last_checkpoint_time = std::max(
            allocation->last_checkpoint_time, std::min(now, FromProto(checkpoint.create_time())));
      }
    }
  }
  keep_spikes();
  {
    GuardedLedger::Hold held(ledger_);
    const v1::TrainerReport& first = request.reports(0);
    Allocation* allocation = held->Find(first.job_id());
    if (allocation != nullptr && allocation->attempt == first.attempt()) {
      int64_t& acked = allocation->acked_sequence[request.node_id()];
      acked = std::max(acked, last_sequence);
    }
  }
  v1::ReportResponse response;
  response.set_acked_sequence(last_sequence);
  return response;
}

}  // namespace tessera::coordinator
