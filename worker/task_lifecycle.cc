#include "worker/task_lifecycle.h"

namespace tessera::worker {

std::optional<TaskPhase> NextPhase(TaskPhase from, TaskEvent event) {
  using P = TaskPhase;
  using E = TaskEvent;
  switch (event) {
    case E::kLaunched:
      if (from == P::kPending) return P::kRunning;
      break;
    case E::kStopOrdered:
      // A task asked to checkpoint is already stopping: the save keeps its grace.
      if (from == P::kPending) return P::kStopBeforeLaunch;
      if (from == P::kRunning) return P::kStopping;
      break;
    case E::kCheckpointOrdered:
      // Nothing to save before the launch: a plain stop.
      if (from == P::kPending) return P::kStopBeforeLaunch;
      if (from == P::kRunning) return P::kCheckpointing;
      break;
    case E::kJudged:
      if (from == P::kPending || from == P::kStopBeforeLaunch || from == P::kRunning ||
          from == P::kCheckpointing || from == P::kStopping) {
        return P::kEnded;
      }
      break;
    case E::kEndReady:
      if (from == P::kEnded) return P::kEndAnnounced;
      break;
    case E::kEndSent:
      if (from == P::kEnded || from == P::kEndAnnounced) return P::kEndSent;
      break;
  }
  return std::nullopt;
}

std::string_view TaskPhaseName(TaskPhase phase) {
  switch (phase) {
    case TaskPhase::kPending:
      return "pending";
    case TaskPhase::kStopBeforeLaunch:
      return "stop-before-launch";
    case TaskPhase::kRunning:
      return "running";
    case TaskPhase::kCheckpointing:
      return "checkpointing";
    case TaskPhase::kStopping:
      return "stopping";
    case TaskPhase::kEnded:
      return "ended";
    case TaskPhase::kEndAnnounced:
      return "end-announced";
    case TaskPhase::kEndSent:
      return "end-sent";
  }
  return "unknown";
}

v1::TaskState TaskLifecycle::state() const {
  switch (phase_) {
    case TaskPhase::kPending:
    case TaskPhase::kStopBeforeLaunch:
      return v1::TASK_STATE_STARTING;
    case TaskPhase::kRunning:
    case TaskPhase::kCheckpointing:
    case TaskPhase::kStopping:
      return v1::TASK_STATE_RUNNING;
    case TaskPhase::kEnded:
    case TaskPhase::kEndAnnounced:
    case TaskPhase::kEndSent:
      return verdict_;
  }
  return v1::TASK_STATE_UNSPECIFIED;
}

bool TaskLifecycle::ended() const {
  return phase_ == TaskPhase::kEnded || phase_ == TaskPhase::kEndAnnounced ||
         phase_ == TaskPhase::kEndSent;
}

bool TaskLifecycle::on_its_way_out() const {
  return phase_ != TaskPhase::kPending && phase_ != TaskPhase::kRunning;
}

bool TaskLifecycle::unlaunched() const {
  return phase_ == TaskPhase::kPending || phase_ == TaskPhase::kStopBeforeLaunch;
}

bool TaskLifecycle::judging() const {
  return phase_ == TaskPhase::kRunning || phase_ == TaskPhase::kCheckpointing ||
         phase_ == TaskPhase::kStopping;
}

bool TaskLifecycle::Apply(TaskEvent event) {
  std::optional<TaskPhase> next = NextPhase(phase_, event);
  if (!next) return false;
  phase_ = *next;
  return true;
}

bool TaskLifecycle::Launched() { return Apply(TaskEvent::kLaunched); }

bool TaskLifecycle::StopOrdered() { return Apply(TaskEvent::kStopOrdered); }

bool TaskLifecycle::CheckpointOrdered(absl::Time deadline) {
  if (!Apply(TaskEvent::kCheckpointOrdered)) return false;
  if (phase_ == TaskPhase::kCheckpointing) checkpoint_deadline_ = deadline;
  return true;
}

bool TaskLifecycle::Judged(v1::TaskState verdict) {
  if (verdict != v1::TASK_STATE_SUCCEEDED && verdict != v1::TASK_STATE_FAILED &&
      verdict != v1::TASK_STATE_STOPPED) {
    return false;
  }
  if (!Apply(TaskEvent::kJudged)) return false;
  verdict_ = verdict;
  checkpoint_deadline_.reset();
  return true;
}

bool TaskLifecycle::EndReady() { return Apply(TaskEvent::kEndReady); }

bool TaskLifecycle::EndSent() { return Apply(TaskEvent::kEndSent); }

}  // namespace tessera::worker
