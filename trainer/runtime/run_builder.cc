#include "trainer/runtime/run_builder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "planner/hf_config.h"
#include "planner/job_plan.h"
#include "planner/layout_rules.h"
#include "planner/lora.h"
#include "planner/lr_schedule.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"
#include "trainer/engine/data_parallelism.h"
#include "trainer/io/checkpoint_fence.h"
#include "trainer/io/step_metrics_log.h"
#include "trainer/model/build_model.h"
#include "trainer/parallel/context_parallelism.h"
#include "trainer/parallel/expert_parallel.h"
#include "trainer/parallel/pipeline_parallelism.h"
#include "trainer/parallel/tensor_parallelism.h"

#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tessera::trainer {
namespace {

// ZeRO-3 builds the model without memory; the engine gives each rank its shards only.
bool DeferredInit(const v1::TrainerTask& task) {
  return task.plan().layout().zero_stage() == 3 && !task.spec().has_lora();
}

// The model step's options: the partition tensor and pipeline parallelism give this rank, and
// what is applied to the built model.
ModelBuildOptions ModelOptionsFor(const v1::TrainerTask& task, const TrainingRun& run,
                                  const TensorParallel& tp, const PipelineStage& stage,
                                  const ContextParallel& cp) {
  const v1::JobSpec& spec = task.spec();
  return ModelBuildOptions{
      .dims = run.summary.dims(),
      .init_std = run.settings.init_std,
      .seed = run.settings.seed,
      .partition = ModelPartition{.tp = tp,
                                  .ep = ExpertParallelOf(run.mesh),
                                  .first_layer = stage.first_layer,
                                  .num_layers = stage.num_layers,
                                  .chunks = stage.chunks,
                                  .chunk_stride = stage.chunk_stride,
                                  .embedding = stage.first(),
                                  .head = stage.last(),
                                  .cp = cp},
      .deferred = DeferredInit(task),
      .from_pretrained =
          spec.model().has_from_pretrained() ? spec.model().from_pretrained() : std::string(),
      .lora = task.plan().has_lora() ? std::optional(planner::FromLoraPlan(task.plan().lora()))
                                     : std::nullopt,
      .device = run.device.device,
      .bf16 = run.settings.bf16,
      .checkpointing = run.checkpointing};
}

// The engine step's options, less what ApplyDataParallel takes from the mesh.
ShardedEngineOptions EngineOptionsFor(const v1::TrainerTask& task, const TrainOptions& options,
                                      const TrainingRun& run, const TensorParallel& tp) {
  ShardedEngineOptions engine;
  engine.zero_stage = task.plan().layout().zero_stage();
  engine.adamw = run.settings.adamw;
  engine.weight_decay = run.settings.weight_decay;
  engine.bf16 = run.settings.bf16;
  engine.tp = tp;
  engine.world_group = run.group.has_value() ? run.group->group : nullptr;
  engine.cuda_graphs = options.cuda_graphs;
  engine.device = run.device.device;
  return engine;
}

// Validation, the device, the defaults and the data: everything before the first collective.
absl::Status PrepareRun(const v1::TrainerTask& task, const RunReporter& reporter, TrainingRun& run,
                        MeshShape* shape, v1::FailureKind* kind) {
  const v1::JobSpec& spec = task.spec();
  *kind = v1::FAILURE_KIND_INVALID_SPEC;
  ASSIGN_OR_RETURN(*shape, ValidateLayout(task));
  ASSIGN_OR_RETURN(run.summary, ResolveModelSummary(task));
  if (spec.has_lora() != task.plan().has_lora()) {
    return absl::FailedPreconditionError(
        absl::StrCat("plan.lora: the task's plan ",
                     spec.has_lora() ? "has no resolved lora for the spec's"
                                     : "has a lora the spec does not ask for",
                     "; a task comes planned, from the coordinator or "
                     "from tessera-trainer --job_spec / --set"));
  }
  RETURN_IF_ERROR(ValidateSplits(run.summary.dims(), *shape, task));
  // Refused before training rather than after it (the export runs once the job is done).
  RETURN_IF_ERROR(planner::CheckExportPolicy(spec, run.summary.dims()));
  ASSIGN_OR_RETURN(run.device, ResolveDevice(task.assignment()));
  ASSIGN_OR_RETURN(run.settings, ResolveRunSettings(task, run.device.device.is_cuda()));
  run.checkpointing = CheckpointingMode(task.plan().layout());

  *kind = v1::FAILURE_KIND_DATA_ERROR;
  auto dataset = OpenTrainingData(spec.data());
  if (!dataset.ok()) return dataset.status();
  run.dataset.emplace(*std::move(dataset));
  *kind = v1::FAILURE_KIND_INVALID_SPEC;
  RETURN_IF_ERROR(CheckVocabulary(*run.dataset, run.summary.dims()));
  RETURN_IF_ERROR(CheckContextParallelData(run.dataset->has_record_starts(), shape->cp));
  run.samples_per_epoch = run.dataset->num_samples();
  ASSIGN_OR_RETURN(run.max_steps, ResolveMaxSteps(spec, run.samples_per_epoch, reporter));
  RETURN_IF_ERROR(planner::ValidateSchedule(spec.optimizer().schedule(), run.max_steps));

  *kind = v1::FAILURE_KIND_DATA_ERROR;
  auto validation = OpenValidationData(spec.data());
  if (!validation.ok()) return validation.status();
  if (validation->has_value()) run.validation.emplace(**std::move(validation));
  return absl::OkStatus();
}

// The mesh, the model and each parallelism applied to it, the engine last. Returns where a
// deferred model's shards come from.
absl::StatusOr<ParameterValues> ParallelizeRun(const v1::TrainerTask& task,
                                               const TrainOptions& options, const MeshShape& shape,
                                               TrainingRun& run, v1::FailureKind* kind) {
  const v1::RankAssignment& assignment = task.assignment();
  if (assignment.world_size() > 1) {
    auto group = JoinWorld(task, options.collective_timeout);
    if (!group.ok()) {
      // AlreadyExists: rank 0 found the master port taken (distributed.h).
      *kind = absl::IsAlreadyExists(group.status()) ? v1::FAILURE_KIND_RENDEZVOUS
                                                    : v1::FAILURE_KIND_COLLECTIVE_TIMEOUT;
      return group.status();
    }
    run.group = *std::move(group);
  }
  *kind = v1::FAILURE_KIND_COLLECTIVE_TIMEOUT;
  ASSIGN_OR_RETURN(run.mesh, DeviceMesh::Create(shape, assignment.rank(),
                                                run.group.has_value() ? &*run.group : nullptr,
                                                {.timeout = options.collective_timeout}));

  // Each parallelism is applied by a function of its own file; a new one adds a line here.
  const v1::Layout& layout = task.plan().layout();
  const v1::ModelDims& dims = run.summary.dims();
  const TensorParallel tp = TensorParallelOf(run.mesh, layout.sequence_parallel());
  const PipelineStage stage = PipelineStageOf(run.mesh, dims.num_layers(), VirtualStagesOf(layout));
  *kind = v1::FAILURE_KIND_INVALID_SPEC;
  const ContextParallel cp = ContextParallelOf(run.mesh);
  ASSIGN_OR_RETURN(BuiltModel built, BuildModel(ModelOptionsFor(task, run, tp, stage, cp)));
  run.model = built.model;
  run.lora = std::move(built.lora);
  // Deferred shards are drawn from the same seed (or read from the same files) on every rank.
  if (!DeferredInit(task)) BroadcastFromFirstDataRank(*run.model, run.mesh);
  // Activations between stages hold a cp rank's part of the sequence (and a tp rank's part of
  // that with sequence parallelism).
  const int64_t seq =
      task.spec().data().seq_len() / cp.size / (tp.sequence_parallel ? tp.size : 1);
  run.pipeline = MakePipelineSchedule(
      run.mesh, {task.spec().batch().micro_batch_size(), seq, dims.hidden_size()},
      run.device.device, stage.chunks);
  run.engine = ApplyDataParallel(run.model, run.mesh, EngineOptionsFor(task, options, run, tp));
  return std::move(built.initial_values);
}

// Checkpoint I/O (resume, and the context saves use), the deferred shards of a fresh start, the
// loader from where the run starts, and the start report.
absl::Status StartRun(const v1::TrainerTask& task, const TrainOptions& options,
                      const RunReporter& reporter, const ParameterValues& initial_values,
                      TrainingRun& run, v1::FailureKind* kind) {
  const CheckpointContext checkpoints = CheckpointContextOf(task, options, run);
  run.checkpointer.emplace(checkpoints);
  v1::DataPosition start;
  start.set_seed(run.settings.seed);
  *kind = v1::FAILURE_KIND_CHECKPOINT_ERROR;
  RETURN_IF_ERROR(RaiseAttemptFence(checkpoints));
  RETURN_IF_ERROR(ResumeFromCheckpoint(checkpoints, run, &start));
  // A resumed checkpoint covers every element of the shards (ResumeLatest refuses holes), so
  // the deferred shards are drawn or read only for a fresh start.
  if (DeferredInit(task) && run.resumed_from.empty()) {
    if (auto status = run.engine->InitializeShards(initial_values); !status.ok()) {
      const bool pretrained = task.spec().model().has_from_pretrained();
      *kind = pretrained ? v1::FAILURE_KIND_INVALID_SPEC : v1::FAILURE_KIND_INTERNAL;
      return pretrained ? FromPretrainedError(status) : status;
    }
  }
  if (options.progress != nullptr) options.progress->SetStep(run.start_step);
  *kind = v1::FAILURE_KIND_INVALID_SPEC;
  ASSIGN_OR_RETURN(BatchLoader loader, MakeLoader(task.spec(), run, start));
  run.loader.emplace(std::move(loader));
  ReportStarted(task, run, reporter);
  ReportCarriedStepMetrics(task, run, reporter);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MeshShape> ValidateLayout(const v1::TrainerTask& task) {
  const v1::Layout& layout = task.plan().layout();
  if (layout.zero_stage() < 0 || layout.zero_stage() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallelism.layout.zero_stage: ", layout.zero_stage(), " is not in 0..3"));
  }
  ASSIGN_OR_RETURN(MeshShape shape, MeshShapeForLayout(layout, task.assignment().world_size()));
  // What this trainer runs: the coordinator refuses the same at submission (planner/job_plan.h).
  RETURN_IF_ERROR(planner::CheckTrainerRuns(layout));
  if (task.spec().has_lora()) RETURN_IF_ERROR(planner::CheckTrainerRunsLora(layout));
  if (layout.sequence_parallel() && shape.tp == 1) {
    return absl::InvalidArgumentError(
        "parallelism.layout.sequence_parallel: needs tensor_parallel > 1");
  }
  return shape;
}

absl::StatusOr<v1::ModelSummary> ResolveModelSummary(const v1::TrainerTask& task) {
  if (task.plan().model().dims().hidden_size() > 0) return task.plan().model();
  return absl::FailedPreconditionError(
      "plan.model: the task's plan has no resolved model; a task comes planned, from the "
      "coordinator or from tessera-trainer --job_spec / --set");
}

absl::Status ValidateSplits(const v1::ModelDims& dims, const MeshShape& shape,
                            const v1::TrainerTask& task) {
  // The rules the coordinator's validation and the layout search apply (planner/layout_rules.h),
  // and nothing else: one place for each rule and its message, so that nothing this trainer
  // refuses was accepted at submission.
  const v1::Layout& layout = task.plan().layout();
  const int64_t per_step = int64_t{task.spec().batch().micro_batch_size()} * std::max(1, shape.dp);
  if (const auto violation = planner::CheckSplitRules(
          dims, task.spec().data().seq_len(),
          {.data_parallel = shape.dp,
           .pipeline_parallel = shape.pp,
           .context_parallel = shape.cp,
           .expert_parallel = shape.ep,
           .pipeline_virtual_stages = layout.pipeline_virtual_stages(),
           .tensor_parallel = shape.tp,
           .sequence_parallel = layout.sequence_parallel(),
           .micro_batches_per_step =
               per_step > 0 ? task.spec().batch().global_batch_size() / per_step : 0})) {
    return absl::InvalidArgumentError(violation->ToString());
  }
  if (const auto violation = planner::CheckModelDivisibility(dims, shape.tp, shape.pp)) {
    return absl::InvalidArgumentError(violation->ToString());
  }
  return absl::OkStatus();
}

absl::StatusOr<RunDevice> ResolveDevice(const v1::RankAssignment& assignment) {
  if (assignment.device_type() != v1::DEVICE_TYPE_CUDA) {
    return RunDevice{.device = torch::Device(torch::kCPU), .name = "cpu"};
  }
#if TESSERA_WITH_CUDA
  if (!torch::cuda::is_available()) {
    return absl::FailedPreconditionError("device_type CUDA: no CUDA device is visible");
  }
  const int index = assignment.gpu_index() >= 0 ? assignment.gpu_index() : assignment.local_rank();
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
  return RunDevice{.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index)),
                   .name = at::cuda::getDeviceProperties(index)->name};
#else
  return absl::FailedPreconditionError(
      "device_type CUDA: this trainer was built without CUDA (TESSERA_WITH_CUDA=OFF)");
#endif
}

absl::StatusOr<RunSettings> ResolveRunSettings(const v1::TrainerTask& task, bool cuda) {
  const v1::LayoutPlan& plan = task.plan();
  if (!planner::HasTrainingSettings(plan) || plan.precision() == v1::PRECISION_UNSPECIFIED) {
    return absl::FailedPreconditionError(
        "plan.settings: the task's plan has no resolved training settings or precision; a task "
        "comes planned, from the coordinator or from tessera-trainer --job_spec / --set");
  }
  const v1::TrainingSettings& settings = plan.settings();
  const v1::Precision precision = plan.precision();
  if (precision == v1::PRECISION_BF16 && !cuda) {
    return absl::InvalidArgumentError("precision: BF16 needs a CUDA device; use FP32 on CPU");
  }
  const double clip = settings.grad_clip_norm();
  return RunSettings{
      .seed = settings.seed(),
      .init_std = settings.init_std(),
      .adamw = {.beta1 = settings.adam_beta1(),
                .beta2 = settings.adam_beta2(),
                .eps = settings.adam_epsilon()},
      .weight_decay = settings.weight_decay(),
      .clip_norm = clip > 0 ? clip : std::numeric_limits<double>::infinity(),
      .eval_batches = settings.eval_batches(),
      .bf16 = precision == v1::PRECISION_BF16};
}

v1::ActivationCheckpointing CheckpointingMode(const v1::Layout& layout) {
  if (layout.activation_checkpointing_mode() != v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED) {
    return layout.activation_checkpointing_mode();
  }
  return layout.activation_checkpointing() ? v1::ACTIVATION_CHECKPOINTING_FULL
                                           : v1::ACTIVATION_CHECKPOINTING_NONE;
}

absl::StatusOr<TokenDataset> OpenTrainingData(const v1::DataSpec& data) {
  return TokenDataset::Open({data.train_shards().begin(), data.train_shards().end()},
                            data.seq_len());
}

absl::Status CheckVocabulary(const TokenDataset& dataset, const v1::ModelDims& dims) {
  if (dataset.vocab_size() > static_cast<uint32_t>(dims.vocab_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.train_shards: tokenizer vocabulary ", dataset.vocab_size(),
                     " is larger than the model's vocab_size ", dims.vocab_size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ResolveMaxSteps(const v1::JobSpec& spec, int64_t samples_per_epoch,
                                        const RunReporter& reporter) {
  if (spec.epochs() <= 0) return spec.max_steps();
  const int64_t batch = spec.batch().global_batch_size();
  if (samples_per_epoch <= 0 || batch <= 0) {
    return absl::InvalidArgumentError("epochs: the training shards hold no sample");
  }
  const double steps =
      std::ceil(spec.epochs() * static_cast<double>(samples_per_epoch) / batch - 1e-9);
  if (!(steps >= 1) || steps > 1e12) {
    return absl::InvalidArgumentError(absl::StrCat("epochs: ", spec.epochs(), " x ",
                                                   samples_per_epoch, " samples / batch ", batch,
                                                   " is not a step count"));
  }
  const auto max_steps = static_cast<int64_t>(steps);
  reporter.Log(absl::StrFormat("%g epoch(s) of %d samples at %d per step: %d steps", spec.epochs(),
                               samples_per_epoch, batch, max_steps));
  return max_steps;
}

absl::StatusOr<std::optional<TokenDataset>> OpenValidationData(const v1::DataSpec& data) {
  if (data.validation_shards_size() == 0 || data.eval_interval_steps() <= 0) {
    return std::optional<TokenDataset>();
  }
  ASSIGN_OR_RETURN(
      TokenDataset validation,
      TokenDataset::Open({data.validation_shards().begin(), data.validation_shards().end()},
                         data.seq_len(), "data.validation_shards"));
  return std::optional<TokenDataset>(std::move(validation));
}

absl::StatusOr<std::optional<JoinedGroup>> JoinWorld(const v1::TrainerTask& task,
                                                     absl::Duration timeout) {
  if (task.assignment().world_size() <= 1) return std::optional<JoinedGroup>();
  const absl::Duration rendezvous = timeout;
  if (task.collective_timeout_seconds() > 0) {
    timeout = absl::Seconds(task.collective_timeout_seconds());
  }
  ASSIGN_OR_RETURN(JoinedGroup group, JoinProcessGroup(task.assignment(),
                                                       {.timeout = timeout,
                                                        .rendezvous_timeout = rendezvous}));
  return std::optional<JoinedGroup>(std::move(group));
}

CheckpointContext CheckpointContextOf(const v1::TrainerTask& task, const TrainOptions& options,
                                      TrainingRun& run) {
  return {.task = &task,
          .rank = task.assignment().rank(),
          .world = task.assignment().world_size(),
          .group = run.group.has_value() ? &*run.group : nullptr,
          .engine = run.engine.get(),
          .log = options.log,
          .kill_in_checkpoint_at_step = options.kill_in_checkpoint_at_step};
}

absl::Status RaiseAttemptFence(const CheckpointContext& context) {
  const std::string& root = context.task->checkpoint_directory();
  if (context.rank != 0 || root.empty()) return absl::OkStatus();
  return RaiseCheckpointFence(root, context.task->job_id(), context.task->attempt());
}

absl::Status ResumeFromCheckpoint(const CheckpointContext& context, TrainingRun& run,
                                  v1::DataPosition* start) {
  ASSIGN_OR_RETURN(std::optional<Resumed> resumed, ResumeLatest(context));
  if (!resumed.has_value()) return absl::OkStatus();
  run.start_step = resumed->manifest.step();
  run.tokens_seen = resumed->manifest.tokens_seen();
  *start = resumed->manifest.data_position();
  run.resumed_from = resumed->path;
  run.restore = resumed->restore;
  const std::string& writer = resumed->manifest.job_id();
  if (context.rank == 0 && !writer.empty() && writer != context.task->job_id()) {
    // Another job's checkpoint: its points are that job's curve. Reported as this job's (now, or
    // by a restart whose coordinator's record starts above step 1) they would be a curve this
    // job never trained.
    run.resumed_other_job = writer;
  } else if (context.rank == 0) {
    // Read from storage (a restore from memory holds the shards only). A file that cannot be read
    // costs the backfill only: the checkpoint's shards verified.
    absl::StatusOr<std::optional<v1::StepMetricsLog>> carried =
        ReadStepMetricsFile(resumed->path, resumed->manifest);
    if (!carried.ok()) {
      run.resumed_step_metrics_problem = std::string(carried.status().message());
    } else if (carried->has_value()) {
      run.resumed_step_metrics = true;
      run.step_metrics.AddAll(**carried, run.start_step);
    }
  }
  return absl::OkStatus();
}

void ReportCarriedStepMetrics(const v1::TrainerTask& task, const TrainingRun& run,
                              const RunReporter& reporter) {
  if (reporter.rank() != 0 || run.resumed_from.empty()) return;
  if (!run.resumed_other_job.empty()) {
    reporter.Log(absl::StrCat("resumed from a checkpoint of job ", run.resumed_other_job, " (step ",
                              run.start_step, "): its step metrics are that job's; none of steps ",
                              "1..", run.start_step, " is reported for job ", task.job_id(),
                              " nor carried by its checkpoints"));
    return;
  }
  if (!task.has_metrics_complete_through_step()) return;
  const int64_t complete = task.metrics_complete_through_step();
  if (complete >= run.start_step) return;
  const v1::StepMetricsLog carried = run.step_metrics.UpTo(run.start_step);
  const Backfill backfill =
      PlanBackfill(run.resumed_step_metrics ? &carried : nullptr, complete, run.start_step);
  for (const v1::StepMetrics& point : backfill.points) {
    v1::TrainerReport report = reporter.NewReport();
    *report.mutable_metrics() = point;
    reporter.SendToWorkerOnly(report);
  }
  std::string line =
      absl::StrCat("the coordinator holds step metrics through step ", complete, "; reported ",
                   backfill.points.size(), " point(s) of steps ", complete + 1, "..",
                   run.start_step, " again from the checkpoint's ", kStepMetricsFileName);
  if (!backfill.uncovered.empty()) {
    std::vector<std::string> ranges;
    for (const auto& [first, last] : backfill.uncovered) {
      ranges.push_back(first == last ? absl::StrCat(first) : absl::StrCat(first, "..", last));
    }
    absl::StrAppend(
        &line, "; steps ", absl::StrJoin(ranges, ", "), " stay missing: ",
        !run.resumed_step_metrics_problem.empty()
            ? absl::StrCat("its step metrics cannot be read (", run.resumed_step_metrics_problem,
                           ")")
        : !run.resumed_step_metrics
            ? std::string("the checkpoint carries no step metrics (written before checkpoints "
                          "carried them)")
        // Fewer than it keeps: the file holds its chain of attempts from the start.
        : static_cast<size_t>(carried.points_size()) < kStepMetricsLogCapacity
            ? std::string("the attempts that wrote the checkpoint started above them (on "
                          "another job's checkpoint, or on one that carried no step metrics)")
            : absl::StrCat("the checkpoint carries the last ", kStepMetricsLogCapacity,
                           " steps' at most"));
  }
  reporter.Log(line);
}

absl::StatusOr<BatchLoader> MakeLoader(const v1::JobSpec& spec, const TrainingRun& run,
                                       const v1::DataPosition& start) {
  return BatchLoader::Create(&*run.dataset,
                             {.global_batch_size = spec.batch().global_batch_size(),
                              .micro_batch_size = spec.batch().micro_batch_size(),
                              .dp_rank = run.mesh.coord(MeshDim::kData),
                              .dp_size = run.mesh.size(MeshDim::kData),
                              .seed = run.settings.seed},
                             start);
}

void ReportStarted(const v1::TrainerTask& task, const TrainingRun& run,
                   const RunReporter& reporter) {
  const torch::Device& device = run.device.device;
  v1::TrainerReport report = reporter.NewReport();
  v1::TrainerStarted* started = report.mutable_started();
  started->set_start_step(run.start_step);
  started->set_num_parameters(run.summary.num_parameters());
  started->set_device(device.is_cuda() ? absl::StrCat(device.str(), " (", run.device.name, ")")
                                       : std::string("cpu"));
  started->set_backend(run.group.has_value() ? run.group->backend
                                             : (device.is_cuda() ? "nccl" : "gloo"));
  started->set_resumed_from(run.resumed_from);
  if (!run.resumed_from.empty()) *started->mutable_restore() = run.restore;
  reporter.Send(report);
  const EngineMemory memory = run.engine->Memory();
  reporter.Log(absl::StrFormat(
      "model %s: %d parameters; %d rank(s) on %s (%s); ZeRO %d, activation checkpointing %s; "
      "%d micro-batch(es) per step; this rank holds %.1f MiB of parameters, %.1f MiB of "
      "gradients, %.1f MiB of optimizer state",
      run.summary.preset().empty() ? "custom" : run.summary.preset(), run.summary.num_parameters(),
      task.assignment().world_size(), device.str(), run.mesh.Describe(),
      task.plan().layout().zero_stage(),
      absl::AsciiStrToLower(absl::StripPrefix(v1::ActivationCheckpointing_Name(run.checkpointing),
                                              "ACTIVATION_CHECKPOINTING_")),
      run.loader->accumulation_steps(), memory.parameter_bytes / 1048576.0,
      memory.gradient_bytes / 1048576.0,
      (memory.moment_bytes + memory.step_counter_bytes) / 1048576.0));
  if (run.pipeline.has_value() && run.pipeline->chunks() > 1) {
    const ModelPartition& partition = run.model->partition();
    reporter.Log(absl::StrFormat(
        "interleaved 1F1B: %d virtual stages per pipeline stage; this stage runs %d chunk(s) of "
        "%d layer(s) from layer %d, %d layers apart",
        partition.chunks, partition.chunks, partition.num_layers, partition.first_layer,
        partition.chunk_stride));
  }
  if (!run.lora.has_value()) return;
  const planner::ResolvedLora& lora = *run.lora;
  const int64_t trainable = lora.parameters_per_layer * run.summary.dims().num_layers();
  reporter.Log(absl::StrFormat(
      "LoRA rank %d, alpha %g, dropout %g on %s: %d trainable parameters (%.3f%%), %.1f MiB "
      "of frozen weights%s",
      lora.rank, lora.alpha, lora.dropout, absl::StrJoin(lora.peft_target_modules, ", "), trainable,
      100.0 * trainable / run.summary.num_parameters(), memory.frozen_bytes / 1048576.0,
      lora.base_nf4 ? " (block linear weights in NF4)" : ""));
}

absl::Status BuildTrainingRun(const v1::TrainerTask& task, const TrainOptions& options,
                              const RunReporter& reporter, TrainingRun& run,
                              v1::FailureKind* kind) {
  MeshShape shape;
  RETURN_IF_ERROR(PrepareRun(task, reporter, run, &shape, kind));
  ASSIGN_OR_RETURN(ParameterValues initial_values, ParallelizeRun(task, options, shape, run, kind));
  return StartRun(task, options, reporter, initial_values, run, kind);
}

}  // namespace tessera::trainer
