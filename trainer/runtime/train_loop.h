// The training loop of one rank over a built TrainingRun (run_builder.h): each step takes the
// loader's micro-batches through the engine (or the pipeline's 1F1B schedule), all-reduces the
// step's loss, refuses a non-finite one, steps AdamW, and reports; between steps it evaluates on
// the held-out shards, starts asynchronous checkpoints, writes the profile, and agrees with the
// other ranks whether to stop early. It builds nothing: what it trains over is the run's.
//
// Thread safety: one thread (the training thread) drives it. The checkpointer's background thread
// sends rank 0's commit reports through the RunReporter.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/runtime/loss_guard.h"
#include "trainer/runtime/run_reporter.h"
#include "trainer/runtime/step_timer.h"
#include "trainer/runtime/train.h"
#include "trainer/runtime/training_run.h"

namespace tessera::trainer {

class TrainLoop {
 public:
  // `task`, `reporter` and `run` must outlive the loop; `run` is fully built.
  TrainLoop(const v1::TrainerTask& task, const TrainOptions& options, const RunReporter& reporter,
            TrainingRun& run);

  // Trains from run.start_step to run.max_steps, or to the step after which the ranks agreed to
  // stop (TrainOptions::stop_requested; that step's checkpoint committed first). On failure
  // `*kind` is the TrainerFailure kind to report. With JobSpec.guard, a step that the ranks agree
  // is a loss spike is not applied and ends the run with FAILURE_KIND_LOSS_SPIKE (no checkpoint
  // of it is started), after rank 0 reported the spike (TrainerReport.loss_spike).
  absl::Status Run(v1::FailureKind* kind);

  // The last step finished (run.start_step before the first).
  int64_t step() const { return step_; }
  const TrainResult& result() const { return result_; }

 private:
  // One optimizer step; returns the step's loss averaged over ranks. A guarded step the ranks
  // judge a spike sets spike_ and is not applied.
  absl::StatusOr<double> TrainStep(double learning_rate, double* grad_norm);
  // The step's micro-batches, after the batches the guard skips at this step (GuardSpec.skipped).
  std::vector<MicroBatch> NextMicroBatches();
  // The guard's verdict on the step about to be applied (grad_norm before clipping): whether to
  // apply it. Every rank takes part (a one-element all-reduce), so that all withhold the same
  // step even if one judged otherwise.
  bool GuardAccepts(double loss, double grad_norm);
  // Forward and backward of the step's micro-batches; returns this rank's share of the step's
  // loss (each micro-batch's mean loss times its LossWeight).
  at::Tensor ForwardBackward(std::vector<MicroBatch>& micro_batches);
  // Under pipeline parallelism, on a stage's forward that is not the last: adds the stage's
  // router loss times router_aux_loss_coef and `weight` (mixture-of-experts models only).
  void AddStageRouterLoss(at::Tensor& step_loss, double weight);
  // Every rank's RankStepMetrics of step_, and rank 0's StepMetrics (with `breakdown` too); logs
  // rank 0's breakdown every kBreakdownLogInterval steps.
  void ReportStep(double loss, double grad_norm, double learning_rate, double seconds,
                  const v1::StepTimeBreakdown& breakdown);
  // After step_: the profile, evaluation, checkpoints, and whether to stop (`*stop`).
  absl::Status FinishStep(bool* stop, v1::FailureKind* kind);
  // Mean loss over the counted targets of the first eval_batches x micro_batch x ranks validation
  // samples (the same ones every time, so evaluations compare), each rank taking its share; rank 0
  // reports it.
  void Evaluate();
  // Validation micro-batch `index` of this dp rank; fewer samples at the data's end.
  MicroBatch ValidationBatch(int index) const;
  // Whether any rank was asked to checkpoint and stop: every rank takes part after every step, so
  // that all stop after the same one.
  bool StopAgreed();
  // Starts the checkpoint of this step in the background (AsyncCheckpointer); the last one (and
  // one asked to `wait`) is waited for, so the job ends with it committed (and, with LoRA, the last
  // one's PEFT adapter written).
  absl::Status SaveCheckpoint(bool last, bool wait = false);
  // The step's peak device (or host) memory; resets the device's peak.
  int64_t PeakMemoryBytes();
  at::Tensor ToDevice(std::vector<int64_t>& values, int batch, int seq);
  // The micro-batch's positions in their records on the device; undefined without records.
  at::Tensor PositionsOf(MicroBatch& mb, int seq);

  const v1::TrainerTask& task_;
  const v1::JobSpec& spec_;
  TrainOptions options_;
  const RunReporter& reporter_;
  TrainingRun& run_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  // Seconds the training thread waited for checkpoints since the last step report.
  double checkpoint_blocked_seconds_ = 0;
  // The part of it inside the current step's wall time (waiting for a snapshot to finish).
  double step_checkpoint_blocked_seconds_ = 0;
  StepTimer timer_;
  // MFU's denominator per rank (0: unknown) and numerator per token.
  const double peak_flops_;
  const double flops_per_token_;
  // The engine's CudaGraphStatus() as last logged.
  std::string graph_status_logged_;
  TrainResult result_;
  // Set with JobSpec.guard; spike_ once a step was judged a spike.
  std::optional<LossGuard> guard_;
  std::optional<v1::LossSpike> spike_;
};

}  // namespace tessera::trainer
