// The builder of a training run: turns a TrainerTask into a ready TrainingRun (training_run.h) in
// small steps, each a function of explicit inputs to explicit outputs, in the spirit of
// torchtitan's parallelize and pipeline functions:
//
//   validate    ValidateLayout, ResolveModelSummary, ValidateSplits
//   device      ResolveDevice, ResolveRunSettings (every default the spec leaves open, as the
//               coordinator resolved them)
//   data        OpenTrainingData, CheckVocabulary, ResolveMaxSteps, OpenValidationData
//   mesh        JoinWorld, then DeviceMesh::Create (trainer/parallel/mesh.h)
//   model       BuildModel (trainer/model/build_model.h) for the partition that tensor and
//               pipeline parallelism give it (trainer/parallel/tensor_parallelism.h,
//               pipeline_parallelism.h); LoRA and activation checkpointing applied there
//   engine      ApplyDataParallel (trainer/engine/data_parallelism.h): ZeRO and AdamW
//   checkpoints CheckpointContextOf, ResumeFromCheckpoint (rank 0 also reads the checkpoint's
//               step metrics)
//   loader      MakeLoader, from the resumed position
//   reports     ReportStarted, ReportCarriedStepMetrics
//
// BuildTrainingRun composes them in that order; adding a parallelism touches its own file and one
// line of the composition. Errors name the spec field at fault; BuildTrainingRun says which
// TrainerFailure kind each is reported as.
//
// Thread safety: the training thread calls these. JoinWorld, DeviceMesh::Create, the model's
// broadcast, the engine, ResumeFromCheckpoint and BuildTrainingRun are collectives over the job's
// ranks, called by every rank in the same order.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/engine/checkpointing.h"
#include "trainer/parallel/mesh.h"
#include "trainer/runtime/run_reporter.h"
#include "trainer/runtime/train.h"
#include "trainer/runtime/training_run.h"

namespace tessera::trainer {

// The layouts this trainer runs: dp x tp x pp (tp with or without sequence parallelism), ZeRO 0-3
// under data parallelism alone and ZeRO 0-1 with tp or pp, any activation checkpointing, LoRA as
// planner::CheckTrainerRunsLora allows. The coordinator refuses the others at submission; this
// guards direct launches. The mesh shape of the task's world; errors name the layout field.
absl::StatusOr<MeshShape> ValidateLayout(const v1::TrainerTask& task);

// The task's model: the one the coordinator resolved (its plan's `model`; a task comes planned,
// from the coordinator or from tessera-trainer's own --job_spec / --set, which plan as it does).
// FAILED_PRECONDITION for a plan without one.
absl::StatusOr<v1::ModelSummary> ResolveModelSummary(const v1::TrainerTask& task);

// What the model's dimensions must allow for the mesh's splits (the planner's rules): each
// parallelism's check, in the order tensor, pipeline, sequence.
absl::Status ValidateSplits(const v1::ModelDims& dims, const MeshShape& shape,
                            const v1::TrainerTask& task);

// The rank's device: the assigned GPU (gpu_index, else local_rank) for DEVICE_TYPE_CUDA, else the
// CPU. FAILED_PRECONDITION when CUDA is asked for and not there.
absl::StatusOr<RunDevice> ResolveDevice(const v1::RankAssignment& assignment);

// The task's settings (RunSettings): its plan's `settings` and `precision` as the coordinator
// resolved them. FAILED_PRECONDITION for a plan without them; INVALID_ARGUMENT for bf16 without
// CUDA.
absl::StatusOr<RunSettings> ResolveRunSettings(const v1::TrainerTask& task, bool cuda);

// The layout's activation checkpointing (the older boolean maps to FULL or NONE).
v1::ActivationCheckpointing CheckpointingMode(const v1::Layout& layout);

// The training shards (data.train_shards) for samples of data.seq_len.
absl::StatusOr<TokenDataset> OpenTrainingData(const v1::DataSpec& data);
// INVALID_ARGUMENT naming data.train_shards when their vocabulary exceeds the model's.
absl::Status CheckVocabulary(const TokenDataset& dataset, const v1::ModelDims& dims);
// max_steps, or what spec.epochs come to over `samples_per_epoch` (logged through `reporter`);
// errors name `epochs`.
absl::StatusOr<int64_t> ResolveMaxSteps(const v1::JobSpec& spec, int64_t samples_per_epoch,
                                        const RunReporter& reporter);
// The validation shards when the spec asks for evaluation; std::nullopt otherwise.
absl::StatusOr<std::optional<TokenDataset>> OpenValidationData(const v1::DataSpec& data);

// The job's process group (std::nullopt for a single process). `timeout` unless the task sets
// collective_timeout_seconds. ALREADY_EXISTS: rank 0 found the master port taken.
absl::StatusOr<std::optional<JoinedGroup>> JoinWorld(const v1::TrainerTask& task,
                                                     absl::Duration timeout);

// What the run's checkpoints read and write (checkpointing.h); points into `run`.
CheckpointContext CheckpointContextOf(const v1::TrainerTask& task, const TrainOptions& options,
                                      TrainingRun& run);

// Rank 0 of a new attempt, before anything is loaded: raises the checkpoint directory's fence to
// this attempt (trainer/io/checkpoint_fence.h), so that no older attempt of the job still running
// commits a checkpoint from now on. FAILED_PRECONDITION when a newer attempt has raised it
// already: this attempt is stale and must end. Nothing on other ranks or without a directory.
absl::Status RaiseAttemptFence(const CheckpointContext& context);

// Restores the newest complete checkpoint into the run's engine (and the CPU RNG) and sets the
// run's start step, tokens seen and resumed_from; `start` gets its data position. Rank 0 also
// takes the checkpoint's step metrics into run.step_metrics (a file that cannot be read is noted in
// run.resumed_step_metrics_problem, not returned), unless another job wrote the checkpoint
// (run.resumed_other_job). Nothing when there is none.
absl::Status ResumeFromCheckpoint(const CheckpointContext& context, TrainingRun& run,
                                  v1::DataPosition* start);

// This rank's batch loader over the run's training data, from `start`.
absl::StatusOr<BatchLoader> MakeLoader(const v1::JobSpec& spec, const TrainingRun& run,
                                       const v1::DataPosition& start);

// Rank 0 of a resumed run: reports again, right after the start, the resumed checkpoint's step
// metrics of the steps the coordinator's record misses (metrics_complete_through_step < step <=
// the resumed step; step_metrics_log.h PlanBackfill), and logs how many, and which steps of that
// range the checkpoint cannot supply and why. Nothing on other ranks, on a fresh start, or when
// the coordinator did not say how far its record is complete (a first attempt, a standalone run).
// A checkpoint another job wrote (a job started on its directory) carries that job's points:
// none is reported, and the log says so.
void ReportCarriedStepMetrics(const v1::TrainerTask& task, const TrainingRun& run,
                              const RunReporter& reporter);

// Reports the start (TrainerStarted) and logs the model, layout and memory lines.
void ReportStarted(const v1::TrainerTask& task, const TrainingRun& run,
                   const RunReporter& reporter);

// Every step above, in order, into `run` (which a failure leaves partly built: the world group,
// once joined, stays for the caller's diagnosis). On failure `*kind` is the TrainerFailure kind
// to report.
absl::Status BuildTrainingRun(const v1::TrainerTask& task, const TrainOptions& options,
                              const RunReporter& reporter, TrainingRun& run, v1::FailureKind* kind);

}  // namespace tessera::trainer
