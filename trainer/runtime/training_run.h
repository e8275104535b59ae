// A training run ready to step: everything the builder (run_builder.h) made from a TrainerTask,
// in one place, for the loop (train_loop.h) to train, evaluate, checkpoint and report over. The
// run holds no behaviour of its own; each part was made by one builder step, named beside it.
//
// Thread safety: owned and used by the training thread. The checkpointer's background thread
// reads the engine's state between AsyncCheckpointer::Start and AwaitSnapshot (checkpointing.h).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "planner/lora.h"
#include "tessera/v1/model.pb.h"
#include "trainer/data/data_loader.h"
#include "trainer/engine/adamw.h"
#include "trainer/engine/checkpointing.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/io/step_metrics_log.h"
#include "trainer/model/model.h"
#include "trainer/parallel/distributed.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/pipeline.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

// The settings the run trains with (ResolveRunSettings): the coordinator's resolution of what the
// job spec leaves unset (LayoutPlan.settings; planner/training_settings.h chooses the defaults).
struct RunSettings {
  // JobSpec.seed, else 1234: the model's initialisation and the data order.
  uint64_t seed = 0;
  // ModelSpec.init_std, else planner::kDefaultInitStd.
  double init_std = 0;
  // OptimizerSpec's betas and epsilon, else 0.9, 0.95 and 1e-8.
  AdamWOptions adamw;
  double weight_decay = 0;
  // OptimizerSpec.grad_clip_norm, else infinity (no clipping).
  double clip_norm = std::numeric_limits<double>::infinity();
  // DataSpec.eval_batches, else 20.
  int eval_batches = 0;
  // JobSpec.precision, else bf16 on CUDA and float32 on the CPU.
  bool bf16 = false;
};

// The device a rank trains on (ResolveDevice).
struct RunDevice {
  torch::Device device = torch::kCPU;
  // The GPU's name ("NVIDIA H100 80GB HBM3"), or "cpu".
  std::string name;
};

// Members are destroyed in reverse order: the checkpointer (waiting for its save) before the
// engine it reads, the loader before its dataset, the mesh before the world group. Neither
// copyable nor movable: the loader and the checkpointer point into it.
struct TrainingRun {
  // ResolveDevice, ResolveRunSettings.
  RunDevice device;
  RunSettings settings;
  // ResolveModelSummary: the model's resolved dimensions and counts (the plan's).
  v1::ModelSummary summary;
  v1::ActivationCheckpointing checkpointing = v1::ACTIVATION_CHECKPOINTING_NONE;
  // OpenTrainingData, ResolveMaxSteps.
  std::optional<TokenDataset> dataset;
  int64_t samples_per_epoch = 1;
  int64_t max_steps = 0;
  // OpenValidationData: held-out samples for evaluation; empty when the job asks for none.
  std::optional<TokenDataset> validation;
  // MakeLoader: this rank's batches, from where the run starts.
  std::optional<BatchLoader> loader;
  // JoinWorld: the job's process group; empty for a single-process job.
  std::optional<JoinedGroup> group;
  // BuildModel: this rank's part of the model; LoRA's resolved spec with LoRA.
  CausalLM model{nullptr};
  std::optional<planner::ResolvedLora> lora;
  // BuildMesh.
  DeviceMesh mesh;
  // ApplyDataParallel: the ZeRO engine over the model.
  std::unique_ptr<ShardedEngine> engine;
  // Background checkpoint writes (after engine: destroyed first, waiting for its save).
  std::optional<AsyncCheckpointer> checkpointer;
  // MakePipelineSchedule: pipeline parallelism only.
  std::optional<PipelineSchedule> pipeline;
  // ResumeFromCheckpoint: where training starts (a resumed checkpoint's step, else 0).
  int64_t start_step = 0;
  int64_t tokens_seen = 0;
  std::string resumed_from;
  // Where the resumed checkpoint came from (memory or storage); unset for a fresh start.
  v1::CheckpointRestore restore;
  // Rank 0: the step metrics of the run's chain of attempts, which its checkpoints carry
  // (trainer/io/step_metrics_log.h): the resumed checkpoint's points, then each step's.
  StepMetricsLog step_metrics;
  // Rank 0 of a resumed run: whether the resumed checkpoint carried step metrics, and why they
  // could not be read when they could not ("" otherwise).
  bool resumed_step_metrics = false;
  std::string resumed_step_metrics_problem;
  // Rank 0: the job that wrote the resumed checkpoint when it is another job (a job started on
  // another's checkpoint directory); its step metrics are that job's and stay out of
  // step_metrics. "" otherwise.
  std::string resumed_other_job;
};

}  // namespace tessera::trainer
