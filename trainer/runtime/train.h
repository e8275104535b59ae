// One rank's training, end to end: RunTraining builds a TrainingRun from a TrainerTask
// (run_builder.h: the device, the data, the job's process group and mesh, the model with each
// parallelism applied, the ZeRO engine, the resumed checkpoint), trains it with the loop
// (train_loop.h: steps, evaluations, asynchronous checkpoints, a report every step), and turns
// every failure on the way into one typed report.
#pragma once

#include <atomic>

#include <cstdint>
#include <ostream>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/report/heartbeat.h"
#include "trainer/report/reporter.h"
#include "trainer/runtime/step_profiler.h"

namespace tessera::trainer {

struct TrainOptions {
  // Longest a rendezvous or collective may block (the task's
  // collective_timeout_seconds wins when set).
  absl::Duration collective_timeout = absl::Minutes(10);
  // Human-readable progress and warnings (skipped checkpoints, ...).
  std::ostream* log = nullptr;
  // Where each step's wall and busy time go, for the rank's heartbeats; may be null.
  RankProgress* progress = nullptr;
  // Fault injection (common/trainer_env.h kFaultNanLossAtStepEnv): from this step on the loss
  // reads NaN. 0: off.
  int64_t nan_loss_from_step = 0;
  // Fault injection (common/trainer_env.h kFaultLossSpikeAtBatchEnv): the step that trains this
  // global batch (from 1) sees its loss 1000 times higher. 0: off.
  int64_t loss_spike_at_batch = 0;
  // Fault injection (common/trainer_env.h kFaultKillInCheckpointAtStepEnv): the save of this
  // step dies half-written. 0: off.
  int64_t kill_in_checkpoint_at_step = 0;
  // --profile_dir / --profile_steps: a Chrome trace of these steps (step_profiler.h).
  StepProfileOptions profile = {};
  // --cuda_graphs: replay each micro-batch's forward and backward as a CUDA graph where the
  // layout allows (ShardedEngineOptions::cuda_graphs); the log says whether it does.
  bool cuda_graphs = false;
  // --step_breakdown: measure where each step's time goes (trainer/runtime/step_timer.h) and
  // report it; off, the steps' reports carry no breakdown and no collective is timed.
  bool step_breakdown = true;
  // Set (by a signal handler: kCheckpointAndStopSignal) when the worker asks this rank to save a
  // checkpoint and stop. After each step the ranks agree whether any was asked (a one-element
  // all-reduce); then they save that step's checkpoint, wait for its commit and return early,
  // TrainResult::stopped set. May be null (never asked).
  const std::atomic<bool>* stop_requested = nullptr;
};

struct TrainResult {
  int64_t start_step = 0;
  int64_t final_step = 0;
  double final_loss = 0;
  std::string resumed_from;
  // Stopped before max_steps as asked (TrainOptions::stop_requested), after the checkpoint of
  // final_step was committed.
  bool stopped = false;
};

// Runs the task to max_steps. Every failure is also sent to `reporter` as a
// typed TrainerFailure (NaN loss, out of memory, collective timeout, a peer
// that went away, data or checkpoint error, ...), stamped with the time it
// was reported, before it is returned. `task.assignment` must be
// resolved (ResolveRankAssignment).
absl::StatusOr<TrainResult> RunTraining(const v1::TrainerTask& task, Reporter& reporter,
                                        const TrainOptions& options);

// Dense bf16 peak FLOP/s of a device by its name, from the planner's device
// presets (0 when unknown, and for the CPU), the denominator of MFU.
double PeakFlopsForDevice(const std::string& device_name);

}  // namespace tessera::trainer
