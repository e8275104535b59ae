// TaskLifecycle: the phases one task goes through on a worker, from the coordinator's assignment
// to the moment the worker forgets it, and the one table of which event moves it from which phase
// to which (NextPhase). The worker's per-rank facts (exit status, heartbeats, signals sent) stay
// with the ranks; what the whole task has been told and decided lives here.
//
//   kPending ──launched──> kRunning ──checkpoint ordered──> kCheckpointing
//      │                     │  │                               │
//      │ stop (or checkpoint)│  └──stop ordered──> kStopping    │
//      v                     │                       │          │
//   kStopBeforeLaunch        └──────judged──────────>├<─────────┘
//      │                                             v
//      └──────────────────judged (STOPPED)─────> kEnded ──end ready──> kEndAnnounced
//                                                    │                        │
//                                                    └───────end sent─────────┴──> kEndSent
//
// kPending also ends at once (judged FAILED when a rank cannot be launched, STOPPED when the
// worker stops). An event that does not apply to a phase (a stop order for a task that has
// already ended, a checkpoint order for one being stopped) leaves it unchanged: the coordinator
// repeats its orders, and the first one that applies wins.
//
// Thread safety: none; the worker keeps each task's lifecycle under its agent's mutex.
#pragma once

#include <optional>
#include <string_view>

#include "absl/time/time.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::worker {

enum class TaskPhase {
  // Accepted, no rank launched yet: held back by the ranks of a task on its way out
  // (WorkerAgent's HeldBackByLocked). Heartbeats say STARTING.
  kPending,
  // Ordered stopped before it launched: ends STOPPED, unlaunched, at the next supervise pass.
  // Heartbeats say STARTING.
  kStopBeforeLaunch,
  // Ranks launched; the supervise loop judges their exits and heartbeats. Heartbeats say RUNNING.
  kRunning,
  // Asked to checkpoint and stop: the ranks were signalled and get until checkpoint_deadline() to
  // save and exit on their own, then are stopped as in kStopping. Heartbeats say RUNNING.
  kCheckpointing,
  // Ordered stopped: the next judgement ends it STOPPED, or FAILED when a rank had already failed
  // on its own. Heartbeats say RUNNING.
  kStopping,
  // Judged (verdict(): SUCCEEDED, FAILED or STOPPED). Heartbeats hold the verdict back (RUNNING)
  // while a rank's process lives or reports are unrelayed, each up to a deadline.
  kEnded,
  // Judged, every process gone and every report relayed: the heartbeat was woken to carry the end.
  kEndAnnounced,
  // A heartbeat carried the verdict to the coordinator: the worker forgets the task once no
  // process or report of it is left.
  kEndSent,
};

// What moves a task between phases.
enum class TaskEvent {
  // Every rank was launched.
  kLaunched,
  // The coordinator ordered the task stopped (or started a later attempt of its job here).
  kStopOrdered,
  // The coordinator asked the task's ranks to save a checkpoint and stop (a plain stop for a task
  // not launched yet).
  kCheckpointOrdered,
  // The supervise loop reached a verdict.
  kJudged,
  // Every process has exited and every report was relayed.
  kEndReady,
  // A heartbeat carried the verdict.
  kEndSent,
};

// The phase `event` moves a task in `from` to; nullopt when the event does not apply there (the
// task stays in `from`). The one place the transitions are written down.
std::optional<TaskPhase> NextPhase(TaskPhase from, TaskEvent event);

std::string_view TaskPhaseName(TaskPhase phase);

class TaskLifecycle {
 public:
  TaskPhase phase() const { return phase_; }
  // What a heartbeat says of the task before the end is held back: STARTING, RUNNING, or the
  // verdict once judged.
  v1::TaskState state() const;
  // Judged: kEnded, kEndAnnounced or kEndSent.
  bool ended() const;
  // Ordered stopped (or asked to checkpoint and stop) or ended: its ranks' GPUs and master port
  // are on their way to being given up, so a new task may wait for them.
  bool on_its_way_out() const;
  // Not launched yet (kPending or kStopBeforeLaunch).
  bool unlaunched() const;
  // The supervise loop judges the task (kRunning, kCheckpointing, kStopping).
  bool judging() const;
  // SUCCEEDED, FAILED or STOPPED once ended; TASK_STATE_UNSPECIFIED before.
  v1::TaskState verdict() const { return verdict_; }
  // Until when the ranks may save their checkpoint; set in kCheckpointing only.
  std::optional<absl::Time> checkpoint_deadline() const { return checkpoint_deadline_; }

  // The events; each returns whether the phase changed (false: the event did not apply).
  bool Launched();
  bool StopOrdered();
  bool CheckpointOrdered(absl::Time deadline);
  // `verdict`: TASK_STATE_SUCCEEDED, _FAILED or _STOPPED.
  bool Judged(v1::TaskState verdict);
  bool EndReady();
  bool EndSent();

 private:
  bool Apply(TaskEvent event);

  TaskPhase phase_ = TaskPhase::kPending;
  v1::TaskState verdict_ = v1::TASK_STATE_UNSPECIFIED;
  std::optional<absl::Time> checkpoint_deadline_;
};

}  // namespace tessera::worker
