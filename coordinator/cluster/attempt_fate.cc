#include "coordinator/cluster/attempt_fate.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/jobs/attempt_policy.h"

namespace tessera::coordinator {
namespace {

bool ResumesFromCheckpoints(const v1::JobSpec& spec) {
  return !spec.checkpoint().has_resume() || spec.checkpoint().resume();
}

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

void AttemptFate::AddFailureLocked(GuardedLedger::Hold& held, const std::string& job_id,
                                   int32_t attempt, const v1::TrainerFailure& failure) {
  Allocation* allocation = held->Find(job_id);
  if (allocation == nullptr || allocation->attempt != attempt) return;  // an earlier attempt's
  allocation->AddFailure(failure, state_->Now());
  if (allocation->phase() == Allocation::Phase::kRunning) {
    allocation->SetPhase(Allocation::Phase::kFailing);
  }
}

void AttemptFate::AddLossSpikeLocked(GuardedLedger::Hold& held, const std::string& job_id,
                                     int32_t attempt, const v1::LossSpike& spike) {
  Allocation* allocation = held->Find(job_id);
  if (allocation == nullptr || allocation->attempt != attempt) return;
  allocation->spike = spike;
}

void AttemptFate::ExpireNodesLocked(GuardedLedger::Hold& held, absl::Time now) {
  for (const auto& [node_id, silence] : nodes_->Expire()) {
    const std::string reason = absl::StrCat("no heartbeat for ", absl::FormatDuration(silence));
    for (const auto& job_id : held->JobsOn(node_id)) {
      Allocation& allocation = *held->Find(job_id);
      allocation.MarkLost(node_id);
      if (allocation.phase() == Allocation::Phase::kDraining) continue;
      v1::TrainerFailure failure;
      failure.set_kind(v1::FAILURE_KIND_NODE_LOST);
      failure.set_rank(-1);
      failure.set_node_id(node_id);
      failure.set_message(reason);
      *failure.mutable_time() = ToProto(now);
      AddFailureLocked(held, job_id, allocation.attempt, failure);
    }
  }
}

void AttemptFate::DrainLocked(GuardedLedger::Hold& held, const std::string& job_id,
                              Allocation& allocation) {
  allocation.SetPhase(Allocation::Phase::kDraining);
  StopTasksLocked(held, job_id, allocation, /*checkpoint=*/false);
}

void AttemptFate::MoveLocked(GuardedLedger::Hold& held, const std::string& job_id,
                             Allocation& allocation) {
  allocation.SetPhase(Allocation::Phase::kMoving);
  StopTasksLocked(held, job_id, allocation, /*checkpoint=*/true);
}

void AttemptFate::MovedLocked(GuardedLedger::Hold& /*held*/, Allocation& allocation) {
  if (allocation.phase() == Allocation::Phase::kRunning) {
    allocation.SetPhase(Allocation::Phase::kMoving);
  }
}

void AttemptFate::StopTasksLocked(GuardedLedger::Hold& /*held*/, const std::string& job_id,
                                  Allocation& allocation, bool checkpoint) {
  for (const auto& node : allocation.Nodes()) {
    if (allocation.NodeEnded(node)) continue;
    const std::string task_id = TaskId(job_id, allocation.attempt, node);
    if (state_->orders.WithdrawStart(node, task_id)) {
      allocation.SetTaskState(node, v1::TASK_STATE_STOPPED);  // never started
    } else if (checkpoint) {
      std::optional<absl::Duration> deadline;
      if (!allocation.preempted.empty()) deadline = allocation.preemption_deadline;
      state_->orders.QueueCheckpointAndStop(node, task_id, deadline);
    } else {
      state_->orders.QueueStop(node, task_id);
    }
  }
}

void AttemptFate::PrepareLocked(GuardedLedger::Hold& /*held*/, const std::string& job_id,
                                Allocation& allocation, absl::Time now,
                                std::vector<Ending>* endings) {
  auto add = [&](Ending::Kind kind) {
    Ending& ending = endings->emplace_back();
    ending.kind = kind;
    ending.job_id = job_id;
    ending.attempt = allocation;
  };
  if (allocation.phase() == Allocation::Phase::kFailing) {
    // Blamed once the settle rules allow: the whole failure_settle when only consequences came
    // in, blame_grace once a cause is known, at once when every node has ended.
    const bool cause_known = std::any_of(allocation.failures.begin(), allocation.failures.end(),
                                         [](const auto& f) { return !IsConsequence(f); });
    const absl::Duration waited = now - allocation.first_failure_time;
    // Rank 0's spike report travels in the report stream while the ranks' ends come with the
    // heartbeat, and a loaded worker's stream can lag its heartbeat by more than blame_grace: a
    // spike's attempt waits for the report up to the whole failure_settle, so that its rollback
    // records the figures (it is decided without them after that).
    const bool spike_known = allocation.spike.has_value();
    const bool spike_report_due =
        !spike_known &&
        std::any_of(allocation.failures.begin(), allocation.failures.end(),
                    [](const auto& f) { return f.kind() == v1::FAILURE_KIND_LOSS_SPIKE; });
    if (waited >= state_->options.failure_settle ||
        (!spike_report_due &&
         (allocation.AllNodesEnded() || (cause_known && waited >= state_->options.blame_grace)))) {
      add(Ending::Kind::kFailure);
      if (spike_known) endings->back().spike = allocation.spike;
    }
    return;
  }
  if (allocation.phase() == Allocation::Phase::kMoving) {
    if (allocation.AllNodesIn(v1::TASK_STATE_SUCCEEDED)) {
      // It finished before it could move: recorded as a success.
      allocation.SetPhase(Allocation::Phase::kRunning);
    } else {
      if (allocation.AllNodesEnded()) {
        add(Ending::Kind::kMove);
      }
      return;
    }
  }
  // A success whose recording failed earlier is recorded now (unless a heartbeat is recording it).
  if (allocation.phase() == Allocation::Phase::kRunning && !allocation.success_pending &&
      allocation.AllNodesIn(v1::TASK_STATE_SUCCEEDED)) {
    allocation.success_pending = true;
    add(Ending::Kind::kSuccess);
  }
}

void AttemptFate::StoreEndings(std::vector<Ending>& endings, absl::Time now) {
  for (Ending& ending : endings) {
    switch (ending.kind) {
      case Ending::Kind::kFailure:
        StoreFailure(&ending, now);
        break;
      case Ending::Kind::kMove:
        StoreMove(&ending, now);
        break;
      case Ending::Kind::kSuccess:
        ending.drain = RecordSuccess(ending.job_id, SuccessOf(ending.attempt));
        break;
    }
  }
}

void AttemptFate::FinishLocked(GuardedLedger::Hold& held, const std::vector<Ending>& endings) {
  for (const Ending& ending : endings) {
    Allocation* allocation = held->Find(ending.job_id);
    if (allocation == nullptr || allocation->attempt != ending.attempt.attempt) continue;
    if (ending.kind == Ending::Kind::kSuccess) {
      allocation->success_pending = false;
      // Otherwise the next pass records it (a store error) or drains it (a node was lost since).
      if (ending.drain && allocation->phase() == Allocation::Phase::kRunning) {
        allocation->SetPhase(Allocation::Phase::kDraining);
      }
      continue;
    }
    if (ending.counted.has_value()) {
      absl::MutexLock lock(&counts_mu_);
      ++(ending.restart ? restarts_ : failures_)[*ending.counted];
    }
    if (ending.drain) {
      allocation->spike.reset();
      DrainLocked(held, ending.job_id, *allocation);
    }
  }
}

std::optional<v1::Job> AttemptFate::JobToEnd(Ending* ending, const char* why) {
  absl::StatusOr<v1::Job> job = state_->store->GetJob(ending->job_id);
  if (!job.ok()) {
    LogRetried(job.status(), absl::StrCat("reading job ", ending->job_id, " ", why));
    return std::nullopt;
  }
  if (IsTerminal(job->state())) {  // cancelled meanwhile
    ending->drain = true;
    return std::nullopt;
  }
  return *std::move(job);
}

void AttemptFate::StoreFailure(Ending* ending, absl::Time now) {
  const Allocation& allocation = ending->attempt;
  std::optional<v1::Job> job = JobToEnd(ending, "to settle its failure");
  if (!job) return;
  const size_t blamed = BlameIndex(allocation.failures);
  v1::TrainerFailure primary = allocation.failures[blamed];
  if (primary.step() == 0) {
    auto rank = allocation.rank_times.find(primary.rank());
    primary.set_step(rank != allocation.rank_times.end() ? rank->second.step()
                                                         : job->current_step());
  }
  if (primary.kind() == v1::FAILURE_KIND_LOSS_SPIKE && job->spec().has_guard()) {
    StoreSpike(ending, *job, primary, blamed, now);
    return;
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
  StoreAttemptEnd(
      ending, *job, primary, blamed, now, retry, reason, resume_step, std::nullopt,
      [](v1::Job& stored) { stored.set_restarts(stored.restarts() + 1); }, "ending");
}

void AttemptFate::StoreSpike(Ending* ending, const v1::Job& job, const v1::TrainerFailure& primary,
                             size_t blamed, absl::Time now) {
  const Allocation& allocation = ending->attempt;
  // The spike's step never committed a checkpoint (the trainer stops before saving it), so the
  // newest checkpoint is of a good step.
  const int64_t resume_step =
      ResumesFromCheckpoints(job.spec()) ? job.latest_checkpoint().step() : 0;
  const SpikeDecision decision =
      DecideSpike(job, allocation.attempt, primary, ending->spike, resume_step);
  const bool rollback = decision.rollback.has_value();
  std::optional<v1::JobEvent> event;
  if (rollback) *event.emplace().mutable_rollback() = *decision.rollback;
  StoreAttemptEnd(
      ending, job, primary, blamed, now, rollback, decision.reason, resume_step, event,
      [&](v1::Job& stored) {
        // Counted against guard.max_rollbacks, not max_restarts: the job did not fault, its data
        // did.
        *stored.add_rollbacks() = *decision.rollback;
      },
      "rolling back");
}

void AttemptFate::StoreAttemptEnd(Ending* ending, const v1::Job& job,
                                  const v1::TrainerFailure& primary, size_t blamed, absl::Time now,
                                  bool restart, const std::string& reason, int64_t resume_step,
                                  const std::optional<v1::JobEvent>& extra_event,
                                  absl::FunctionRef<void(v1::Job&)> on_restart,
                                  absl::string_view doing) {
  const std::string& job_id = ending->job_id;
  const Allocation& allocation = ending->attempt;
  v1::JobAttempt record = EndedAttempt(allocation, job, now, DescribeFailure(primary));
  *record.mutable_failure() = primary;
  std::vector<v1::JobEvent> events;
  *events.emplace_back().mutable_failure() = primary;
  for (size_t i = 0; i < allocation.failures.size(); ++i) {
    if (i == blamed) continue;
    *record.add_consequences() = allocation.failures[i];
    *events.emplace_back().mutable_failure() = allocation.failures[i];
  }
  if (extra_event) events.push_back(*extra_event);
  auto transitioned = jobs_->Transition(
      job_id, restart ? v1::JOB_STATE_RESTARTING : v1::JOB_STATE_FAILED, reason,
      [&](v1::Job& stored) {
        *stored.mutable_failure() = primary;
        *stored.add_attempts() = record;
        if (!restart) return;
        on_restart(stored);
        stored.set_attempt(stored.attempt() + 1);
        stored.mutable_placements()->Clear();
        // Steps after the checkpoint are trained again: their metrics (and events) are those of
        // the new attempt.
        stored.set_current_step(resume_step);
      },
      events);
  if (!transitioned.ok() && !absl::IsFailedPrecondition(transitioned.status())) {
    LogRetried(transitioned.status(),
               absl::StrCat(doing, " attempt ", allocation.attempt, " of job ", job_id));
    return;
  }
  if (transitioned.ok()) {
    ending->counted = primary.kind();
    ending->restart = restart;
  }
  ending->drain = true;
}

void AttemptFate::StoreMove(Ending* ending, absl::Time now) {
  const std::string& job_id = ending->job_id;
  const Allocation& allocation = ending->attempt;
  std::optional<v1::Job> job = JobToEnd(ending, "to queue it again");
  if (!job) return;
  const int64_t resume_step =
      ResumesFromCheckpoints(job->spec()) ? job->latest_checkpoint().step() : 0;
  const std::string resume_from = absl::StrCat(
      "placed again from ",
      resume_step > 0 ? absl::StrCat("the checkpoint of step ", resume_step)
                      : std::string("the start"),
      " (no restart counted)");
  std::string description;
  std::string reason;
  v1::JobState next = v1::JOB_STATE_RESTARTING;
  if (!allocation.preempted.empty()) {
    // Preempted: back to PENDING, saying whether the ranks saved as asked. They did when the
    // newest checkpoint came after the order and is of the step they stopped at; ranks that
    // ignored the order trained on past their last periodic checkpoint until the worker stopped
    // them at the deadline.
    const v1::Checkpoint& latest = job->latest_checkpoint();
    const bool saved = latest.step() > 0 && latest.step() >= job->current_step() &&
                       latest.has_create_time() &&
                       FromProto(latest.create_time()) >= allocation.preempted_time;
    const std::string outcome =
        saved ? absl::StrCat("checkpoint step ", latest.step(), " saved in ",
                             absl::StrFormat("%.1f s", absl::ToDoubleSeconds(
                                                           FromProto(latest.create_time()) -
                                                           allocation.preempted_time)))
              : absl::StrCat("no checkpoint of step ", job->current_step(),
                             " saved within the deadline (",
                             absl::FormatDuration(allocation.preemption_deadline),
                             "): the ranks were stopped");
    description = absl::StrCat(allocation.preempted, ", ", outcome);
    reason = absl::StrCat(description, "; waits to be ", resume_from);
    next = v1::JOB_STATE_PENDING;
  } else {
    description = absl::StrCat(allocation.moving_off.empty()
                                   ? std::string("a node was drained")
                                   : absl::StrCat("node ", allocation.moving_off, " drained"),
                               ": attempt ", allocation.attempt,
                               " saved a checkpoint and stopped");
    reason = absl::StrCat(description, "; ", resume_from);
  }
  v1::JobAttempt record = EndedAttempt(allocation, *job, now, description);
  auto transitioned = jobs_->Transition(job_id, next, reason, [&](v1::Job& stored) {
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
  ending->drain = true;
}

AttemptFate::SuccessRecord AttemptFate::SuccessOf(const Allocation& allocation) {
  SuccessRecord record;
  record.attempt = allocation.attempt;
  record.nodes = allocation.Nodes();
  record.world_size = static_cast<int>(allocation.ranks.size());
  record.start_step = allocation.start_step;
  record.placed_time = allocation.placed_time;
  return record;
}

bool AttemptFate::RecordSuccess(const std::string& job_id, const SuccessRecord& success) {
  // A job that already ended (cancelled meanwhile, or recorded by an earlier try) is left as it
  // is: the transition says FAILED_PRECONDITION.
  const absl::Time now = state_->Now();
  auto succeeded = jobs_->Transition(job_id, v1::JOB_STATE_SUCCEEDED, "every rank finished",
                                     [&](v1::Job& stored) {
                                       v1::JobAttempt* record = stored.add_attempts();
                                       record->set_attempt(success.attempt);
                                       for (const auto& node : success.nodes)
                                         record->add_node_ids(node);
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

}  // namespace tessera::coordinator
