#include "coordinator/jobs/job_manager.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "coordinator/admission/job_validation.h"
#include "coordinator/queues/queue_admission.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

v1::JobEvent StateEvent(v1::JobState from, v1::JobState to, const std::string& reason) {
  v1::JobEvent event;
  event.mutable_state_change()->set_previous_state(from);
  event.mutable_state_change()->set_new_state(to);
  event.mutable_state_change()->set_reason(reason);
  return event;
}

}  // namespace

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

JobManager::JobManager(Store* store, Clock* clock, QueueFile* queues)
    : store_(store), clock_(clock), queues_(queues) {}

absl::StatusOr<std::string> JobManager::RouteToQueue(const v1::JobSpec& spec,
                                                     const std::string& owner,
                                                     int world_size) const {
  const std::shared_ptr<const QueueConfig> config =
      queues_ != nullptr ? queues_->Current() : std::make_shared<const QueueConfig>();
  Submission submission;
  submission.owner = owner;
  submission.labels.insert(spec.labels().begin(), spec.labels().end());
  submission.requested_queue = spec.queue();
  auto queue = QueueFor(*config, submission);
  if (!queue.ok()) {
    return absl::Status(queue.status().code(), absl::StrCat("queue: ", queue.status().message()));
  }
  QueuedRequest request;
  request.queue = *queue;
  request.use_gpus = spec.resources().gpus() > 0;
  request.devices = world_size;
  if (std::optional<std::string> never = QuotaUnsatisfiable(*config, request)) {
    return absl::FailedPreconditionError(absl::StrCat("queue: ", *never));
  }
  return queue;
}

google::protobuf::Timestamp JobManager::NowTimestamp() const {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(clock_->Now()));
}

void JobManager::NotifyWatchers(const std::string& job_id) {
  std::vector<std::function<void()>> to_call;
  {
    absl::MutexLock lock(&listeners_mu_);
    for (const auto& [handle, entry] : listeners_) {
      if (entry.first == job_id) to_call.push_back(entry.second);
    }
  }
  for (auto& listener : to_call) listener();
}

void JobManager::SetCommitObserver(std::function<void(const v1::Job&)> observer) {
  absl::MutexLock lock(&listeners_mu_);
  commit_observer_ = std::move(observer);
}

void JobManager::ObserveCommit(const v1::Job& job) {
  std::function<void(const v1::Job&)> observer;
  {
    absl::MutexLock lock(&listeners_mu_);
    observer = commit_observer_;
  }
  if (observer) observer(job);
}

absl::StatusOr<std::vector<v1::JobEvent>> JobManager::CommitAndNotify(const JobWrite& write) {
  ASSIGN_OR_RETURN(auto events, store_->Commit(write));
  if (write.job.has_value()) ObserveCommit(*write.job);
  NotifyWatchers(write.job_id);
  return events;
}

absl::StatusOr<v1::Job> JobManager::Submit(const v1::JobSpec& spec, const std::string& request_id,
                                           const std::string& owner) {
  // The spec is validated and resolved once, here; the plan records what it resolved to.
  ASSIGN_OR_RETURN(const ResolvedJob resolved, ResolveJob(spec));
  RETURN_IF_ERROR(ValidateTrainerRuns(spec));
  ASSIGN_OR_RETURN(std::string queue, RouteToQueue(spec, owner, resolved.world_size));
  v1::LayoutPlan plan = PlanJob(spec, resolved);
  const std::string owned_request_id =
      request_id.empty() ? "" : absl::StrCat(owner, "/", request_id);
  // Only a repeated request id needs the lock: a new job's id is unknown to anyone else until it
  // is returned.
  std::optional<KeyedMutex::Hold> lock;
  if (!owned_request_id.empty()) lock.emplace(&submit_locks_, owned_request_id);
  if (!owned_request_id.empty()) {
    ASSIGN_OR_RETURN(auto existing, store_->FindJobByRequestId(owned_request_id));
    if (existing.has_value()) return *existing;
  }
  v1::Job job;
  *job.mutable_spec() = spec;
  *job.mutable_plan() = std::move(plan);
  job.set_owner(owner);
  job.set_queue(std::move(queue));
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_reason("waiting to be scheduled");
  *job.mutable_create_time() = NowTimestamp();
  JobWrite write;
  write.request_id = owned_request_id;
  write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING, "submitted"));
  write.job = std::move(job);
  // The id is allocated in the submission's own transaction.
  RETURN_IF_ERROR(store_->CommitNewJob(&write));
  ObserveCommit(*write.job);
  NotifyWatchers(write.job_id);
  return *std::move(write.job);
}

absl::StatusOr<v1::Job> JobManager::Get(const std::string& job_id) {
  return store_->GetJob(job_id);
}

absl::StatusOr<JobPage> JobManager::List(const std::vector<v1::JobState>& states, int page_size,
                                         const std::string& page_token) {
  if (page_size < 0) return absl::InvalidArgumentError("page_size: must be >= 0");
  return store_->ListJobs(states, page_size, page_token);
}

absl::StatusOr<v1::Job> JobManager::Cancel(const std::string& job_id, const std::string& reason) {
  {
    ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(job_id));
    if (IsTerminal(job.state())) return job;
  }
  auto cancelled = Transition(
      job_id, v1::JOB_STATE_CANCELLED,
      reason.empty() ? std::string("cancelled by a user") : absl::StrCat("cancelled: ", reason));
  // Lost a race with another terminal transition: report the job as it is.
  if (absl::IsFailedPrecondition(cancelled.status())) return store_->GetJob(job_id);
  return cancelled;
}

absl::StatusOr<v1::Job> JobManager::Transition(const std::string& job_id, v1::JobState state,
                                               const std::string& reason,
                                               const std::function<void(v1::Job&)>& mutate,
                                               const std::vector<v1::JobEvent>& preceding_events) {
  return TransitionChecked(job_id, nullptr, state, reason, mutate, preceding_events);
}

absl::StatusOr<v1::Job> JobManager::TransitionIf(
    const std::string& job_id, const std::function<absl::Status(const v1::Job&)>& precondition,
    v1::JobState state, const std::string& reason, const std::function<void(v1::Job&)>& mutate) {
  return TransitionChecked(job_id, precondition, state, reason, mutate, {});
}

absl::StatusOr<v1::Job> JobManager::TransitionChecked(
    const std::string& job_id, const std::function<absl::Status(const v1::Job&)>& precondition,
    v1::JobState state, const std::string& reason, const std::function<void(v1::Job&)>& mutate,
    const std::vector<v1::JobEvent>& preceding_events) {
  const KeyedMutex::Hold lock(&job_locks_, job_id);
  ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(job_id));
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " is ", v1::JobState_Name(job.state()), " and cannot change state"));
  }
  if (precondition) RETURN_IF_ERROR(precondition(job));
  v1::JobState previous = job.state();
  job.set_state(state);
  job.set_reason(reason);
  auto now = NowTimestamp();
  if (state == v1::JOB_STATE_RUNNING && !job.has_start_time()) *job.mutable_start_time() = now;
  if (IsTerminal(state)) *job.mutable_end_time() = now;
  if (mutate) mutate(job);
  JobWrite write;
  write.job_id = job_id;
  write.job = job;
  write.events = preceding_events;
  if (previous != state) write.events.push_back(StateEvent(previous, state, reason));
  RETURN_IF_ERROR(CommitAndNotify(write).status());
  return job;
}

std::vector<absl::StatusOr<v1::Job>> JobManager::TransitionAll(
    const std::vector<TransitionRequest>& requests) {
  std::vector<absl::StatusOr<v1::Job>> results(requests.size(), absl::UnknownError("not stored"));
  std::vector<std::string> job_ids;
  for (const auto& request : requests) job_ids.push_back(request.job_id);
  std::optional<KeyedMutex::HoldAll> locks(std::in_place, &job_locks_, std::move(job_ids));
  std::vector<JobWrite> writes;
  std::vector<size_t> written;  // request index of each write
  const auto now = NowTimestamp();
  for (size_t i = 0; i < requests.size(); ++i) {
    const TransitionRequest& request = requests[i];
    absl::StatusOr<v1::Job> job = store_->GetJob(request.job_id);
    if (!job.ok()) {
      results[i] = job.status();
      continue;
    }
    if (IsTerminal(job->state())) {
      results[i] = absl::FailedPreconditionError(absl::StrCat("job ", request.job_id, " is ",
                                                              v1::JobState_Name(job->state()),
                                                              " and cannot change state"));
      continue;
    }
    if (request.precondition) {
      if (absl::Status status = request.precondition(*job); !status.ok()) {
        results[i] = status;
        continue;
      }
    }
    const v1::JobState previous = job->state();
    job->set_state(request.state);
    job->set_reason(request.reason);
    if (request.state == v1::JOB_STATE_RUNNING && !job->has_start_time()) {
      *job->mutable_start_time() = now;
    }
    if (IsTerminal(request.state)) *job->mutable_end_time() = now;
    if (request.mutate) request.mutate(*job);
    JobWrite& write = writes.emplace_back();
    write.job_id = request.job_id;
    if (previous != request.state) {
      write.events.push_back(StateEvent(previous, request.state, request.reason));
    }
    write.job = *std::move(job);
    written.push_back(i);
  }
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> committed = store_->CommitAll(writes);
  for (size_t w = 0; w < writes.size(); ++w) {
    if (committed[w].ok()) {
      // Still under the jobs' locks: the observer sees each job's changes in commit order.
      ObserveCommit(*writes[w].job);
      results[written[w]] = std::move(*writes[w].job);
    } else {
      results[written[w]] = committed[w].status();
    }
  }
  locks.reset();
  for (size_t w = 0; w < writes.size(); ++w) {
    if (committed[w].ok()) NotifyWatchers(writes[w].job_id);
  }
  return results;
}

absl::Status JobManager::RecordReports(const std::string& job_id,
                                       const std::vector<v1::StepMetrics>& metrics,
                                       const std::vector<v1::EvalMetrics>& evals,
                                       const std::vector<v1::Checkpoint>& checkpoints,
                                       std::optional<int32_t> attempt) {
  if (metrics.empty() && evals.empty() && checkpoints.empty()) return absl::OkStatus();
  const KeyedMutex::Hold lock(&job_locks_, job_id);
  ASSIGN_OR_RETURN(v1::Job job, store_->GetJob(job_id));
  // A replaced attempt keeps only its checkpoints.
  const bool replaced = attempt.has_value() && *attempt < job.attempt();
  if (replaced && checkpoints.empty()) return absl::OkStatus();
  const std::vector<v1::StepMetrics> no_metrics;
  const std::vector<v1::EvalMetrics> no_evals;
  JobWrite write;
  write.job_id = job_id;
  for (const auto& point : replaced ? no_metrics : metrics) {
    // A mixture of experts' per-expert counts stay in latest_metrics only: stored with every
    // step (curve and events) they would multiply its size (layers x experts values a point);
    // each layer's imbalance is kept.
    v1::StepMetrics& stored = write.metrics.emplace_back(point);
    for (v1::ExpertLoad& load : *stored.mutable_expert_load()) load.clear_tokens();
    if (point.step() <= job.current_step()) continue;
    job.set_current_step(point.step());
    *job.mutable_latest_metrics() = point;
    *write.events.emplace_back().mutable_metrics() = stored;
  }
  for (const auto& eval : replaced ? no_evals : evals) {
    write.evals.push_back(eval);
    *write.events.emplace_back().mutable_eval() = eval;
  }
  for (const auto& reported : checkpoints) {
    // What the commit's retention deleted leaves the records in the same write.
    const absl::Time committed = absl::FromUnixNanos(
        google::protobuf::util::TimeUtil::TimestampToNanoseconds(reported.create_time()));
    for (int64_t step : reported.retired_steps()) {
      write.retired_checkpoints.push_back({.step = step, .time = committed});
    }
    v1::Checkpoint checkpoint = reported;
    checkpoint.clear_retired_steps();
    if (checkpoint.step() >= job.latest_checkpoint().step()) {
      *job.mutable_latest_checkpoint() = checkpoint;
    }
    write.checkpoints.push_back(checkpoint);
    *write.events.emplace_back().mutable_checkpoint() = std::move(checkpoint);
  }
  write.job = job;
  return CommitAndNotify(write).status();
}

std::vector<v1::StepMetrics> Downsample(const std::vector<v1::StepMetrics>& points,
                                        int max_points) {
  if (max_points <= 0 || static_cast<int>(points.size()) <= max_points) return points;
  std::vector<v1::StepMetrics> out;
  const size_t n = points.size();
  for (int bucket = 0; bucket < max_points; ++bucket) {
    size_t begin = n * bucket / max_points, end = n * (bucket + 1) / max_points;
    if (begin == end) continue;
    v1::StepMetrics mean = points[end - 1];
    double count = static_cast<double>(end - begin);
    double loss = 0, grad_norm = 0, lr = 0, tokens = 0, samples = 0, mfu = 0, seconds = 0;
    int64_t peak = 0;
    for (size_t i = begin; i < end; ++i) {
      loss += points[i].loss();
      grad_norm += points[i].grad_norm();
      lr += points[i].learning_rate();
      tokens += points[i].tokens_per_second();
      samples += points[i].samples_per_second();
      mfu += points[i].mfu();
      seconds += points[i].step_time_seconds();
      peak = std::max(peak, points[i].peak_memory_bytes());
    }
    mean.set_loss(loss / count);
    mean.set_grad_norm(grad_norm / count);
    mean.set_learning_rate(lr / count);
    mean.set_tokens_per_second(tokens / count);
    mean.set_samples_per_second(samples / count);
    mean.set_mfu(mfu / count);
    mean.set_step_time_seconds(seconds / count);
    mean.set_peak_memory_bytes(peak);
    out.push_back(std::move(mean));
  }
  return out;
}

absl::StatusOr<v1::GetMetricsResponse> JobManager::Metrics(const v1::GetMetricsRequest& request) {
  if (request.max_points() < 0) return absl::InvalidArgumentError("max_points: must be >= 0");
  if (request.from_step() < 0 || request.to_step() < 0) {
    return absl::InvalidArgumentError("from_step, to_step: must be >= 0");
  }
  RETURN_IF_ERROR(store_->GetJob(request.job_id()).status());
  ASSIGN_OR_RETURN(auto points,
                   store_->ReadMetrics(request.job_id(), request.from_step(), request.to_step()));
  ASSIGN_OR_RETURN(auto evals,
                   store_->ReadEvals(request.job_id(), request.from_step(), request.to_step()));
  v1::GetMetricsResponse response;
  for (auto& point : Downsample(points, request.max_points())) {
    *response.add_points() = std::move(point);
  }
  for (auto& eval : evals) *response.add_evals() = std::move(eval);
  return response;
}

absl::StatusOr<std::vector<v1::Checkpoint>> JobManager::Checkpoints(const std::string& job_id) {
  RETURN_IF_ERROR(store_->GetJob(job_id).status());
  return store_->ListCheckpoints(job_id);
}

absl::StatusOr<std::vector<v1::JobEvent>> JobManager::Events(const std::string& job_id,
                                                             int64_t after_sequence, int limit) {
  return store_->ReadEvents(job_id, after_sequence, limit);
}

int64_t JobManager::Subscribe(const std::string& job_id, std::function<void()> listener) {
  absl::MutexLock lock(&listeners_mu_);
  int64_t handle = next_listener_++;
  listeners_[handle] = {job_id, std::move(listener)};
  return handle;
}

void JobManager::CloseWatches() {
  closed_.store(true);
  std::vector<std::function<void()>> to_call;
  {
    absl::MutexLock lock(&listeners_mu_);
    for (const auto& [handle, entry] : listeners_) to_call.push_back(entry.second);
  }
  for (auto& listener : to_call) listener();
}

void JobManager::Unsubscribe(int64_t handle) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(handle);
}

}  // namespace tessera::coordinator
