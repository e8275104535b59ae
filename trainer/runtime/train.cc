#include "trainer/runtime/train.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "common/timestamp.h"
#include "planner/devices.h"
#include "planner/job_plan.h"
#include "planner/lora.h"
#include "planner/lr_schedule.h"
#include "planner/model_config.h"
#include "trainer/engine/checkpointing.h"
#include "trainer/data/data_loader.h"
#include "trainer/parallel/distributed.h"
#include "trainer/model/hf_weights.h"
#include "trainer/parallel/mesh.h"
#include "trainer/model/model.h"
#include "trainer/parallel/peer_wait.h"
#include "trainer/parallel/pipeline.h"
#include "trainer/engine/sharded_engine.h"
#include "trainer/torch_pch.h"

#include <ATen/record_function.h>
#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tessera::trainer {
namespace {

v1::FailureKind ClassifyTorchError(const std::string& what) {
  if (absl::StrContains(what, "out of memory") || absl::StrContains(what, "OutOfMemory")) {
    return v1::FAILURE_KIND_OUT_OF_MEMORY;
  }
  // A collective whose peer went away (Gloo's TCP pairs; the pipeline's send/receive): the
  // consequence of another rank's failure, which that rank (or its worker) reports as the cause.
  // Gloo says which way it noticed: a read of 0 bytes, ECONNRESET, or EPIPE while it was writing.
  for (const char* lost : {"pipeline peer lost", "Connection closed by peer",
                           "Connection reset by peer", "Broken pipe", "Socket closed"}) {
    if (absl::StrContains(what, lost)) return v1::FAILURE_KIND_PEER_FAILED;
  }
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout") || absl::StrContains(what, "timeout")) {
    return v1::FAILURE_KIND_COLLECTIVE_TIMEOUT;
  }
  return v1::FAILURE_KIND_INTERNAL;
}

// A status that carries the failure kind to report.
struct Failure {
  v1::FailureKind kind;
  absl::Status status;
};

int64_t PeakHostMemoryBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

class Trainer {
 public:
  Trainer(const v1::TrainerTask& task, Reporter& reporter, const TrainOptions& options)
      : task_(task),
        spec_(task.spec()),
        assignment_(task.assignment()),
        reporter_(reporter),
        options_(options) {}

  absl::StatusOr<TrainResult> Run() {
    absl::Status status;
    v1::FailureKind kind = v1::FAILURE_KIND_INTERNAL;
    try {
      if (auto setup = Setup(); !setup.ok()) {
        kind = setup_kind_;
        status = setup;
      } else {
        status = TrainLoop(&kind);
      }
    } catch (const CorruptTokenError& e) {
      kind = v1::FAILURE_KIND_DATA_ERROR;
      status = absl::DataLossError(e.what());
    } catch (const c10::Error& e) {
      kind = ClassifyTorchError(e.what());
      status = absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      kind = ClassifyTorchError(e.what());
      status = absl::InternalError(e.what());
    }
    if (!status.ok()) {
      if ((kind == v1::FAILURE_KIND_COLLECTIVE_TIMEOUT || kind == v1::FAILURE_KIND_PEER_FAILED) &&
          group_.has_value()) {
        status = absl::Status(status.code(), absl::StrCat(status.message(), LostRanks()));
      }
      ReportFailure(kind, status);
      return status;
    }
    if (result_.stopped) {
      Log(absl::StrCat("stopped at step ", result_.final_step,
                       " after its checkpoint, as the worker asked (the job moves to other nodes)"));
      return result_;
    }
    v1::TrainerReport report = NewReport();
    report.mutable_finished()->set_final_step(result_.final_step);
    report.mutable_finished()->set_final_loss(result_.final_loss);
    Send(report);
    return result_;
  }

 private:
  int rank() const { return assignment_.rank(); }
  int world() const { return assignment_.world_size(); }

  void Log(const std::string& line) {
    if (options_.log != nullptr) *options_.log << "[rank " << rank() << "] " << line << std::endl;
  }

  v1::TrainerReport NewReport() const {
    v1::TrainerReport report;
    report.set_job_id(task_.job_id());
    report.set_attempt(task_.attempt());
    report.set_rank(rank());
    *report.mutable_time() = NowTimestamp();
    return report;
  }

  void Send(const v1::TrainerReport& report) {
    if (auto status = reporter_.Send(report); !status.ok()) {
      Log(absl::StrCat("report not delivered: ", status.ToString()));
    }
  }

  void ReportFailure(v1::FailureKind kind, const absl::Status& status) {
    v1::TrainerReport report = NewReport();
    v1::TrainerFailure* failure = report.mutable_failure();
    failure->set_kind(kind);
    failure->set_rank(rank());
    failure->set_step(step_);
    failure->set_message(std::string(status.message()));
    // The worker blames the first failure of a task by this time.
    *failure->mutable_time() = report.time();
    Send(report);
    Log(absl::StrCat("failed: ", status.ToString()));
  }

  // After a failed collective: which ranks are gone. A collective error names at best a socket
  // address, so every rank that survives one checks in on the job's store; the ranks that have
  // not checked in after a few seconds are named (dead, or still blocked in a collective).
  std::string LostRanks() {
    constexpr absl::Duration kGrace = absl::Seconds(5);
    try {
      const c10::intrusive_ptr<c10d::Store>& store = group_->store;
      store->set(absl::StrCat("tessera/survived/", rank()), std::vector<uint8_t>{1});
      std::vector<int> missing;
      const absl::Time deadline = absl::Now() + kGrace;
      do {
        missing.clear();
        for (int r = 0; r < world(); ++r) {
          if (!store->check({absl::StrCat("tessera/survived/", r)})) missing.push_back(r);
        }
        if (missing.empty()) return "";
        absl::SleepFor(absl::Milliseconds(200));
      } while (absl::Now() < deadline);
      return absl::StrCat("; rank(s) ", absl::StrJoin(missing, ", "), " did not answer within ",
                          absl::FormatDuration(kGrace),
                          " of the failure (exited, or still blocked in a collective)");
    } catch (const std::exception& e) {
      return absl::StrCat("; the job's store (rank 0) is unreachable too: ",
                          c10::GetExceptionString(e));
    }
  }

  absl::Status Fail(v1::FailureKind kind, absl::Status status) {
    setup_kind_ = kind;
    return status;
  }

  // The layouts this trainer runs: dp x tp x pp (tp with or without sequence parallelism), ZeRO
  // 0-3 under data parallelism alone and ZeRO 0-1 with tp or pp, any activation checkpointing.
  // The coordinator refuses the others at submission; this guards direct launches.
  absl::Status ValidateLayout() {
    const v1::Layout& layout = task_.plan().layout();
    if (layout.zero_stage() < 0 || layout.zero_stage() > 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallelism.layout.zero_stage: ", layout.zero_stage(), " is not in 0..3"));
    }
    ASSIGN_OR_RETURN(shape_, MeshShapeForLayout(layout, world()));
    if (layout.zero_stage() > 1 && (shape_.tp > 1 || shape_.pp > 1)) {
      return absl::UnimplementedError(absl::StrFormat(
          "parallelism.layout.zero_stage: %d with tensor_parallel %d and pipeline_parallel %d: "
          "this trainer runs ZeRO 2 and 3 under data parallelism alone; use zero_stage 0 or 1",
          layout.zero_stage(), shape_.tp, shape_.pp));
    }
    if (spec_.has_lora()) RETURN_IF_ERROR(planner::CheckTrainerRunsLora(layout));
    if (layout.sequence_parallel() && shape_.tp == 1) {
      return absl::InvalidArgumentError(
          "parallelism.layout.sequence_parallel: needs tensor_parallel > 1");
    }
    return absl::OkStatus();
  }

  // What the model's dimensions must allow for the layout's splits (the planner's rules).
  absl::Status ValidateSplits() {
    const v1::ModelDims& dims = summary_.dims();
    const int tp = shape_.tp, pp = shape_.pp;
    auto refuse = [](const std::string& field, const std::string& problem) {
      return absl::InvalidArgumentError(absl::StrCat("parallelism.layout.", field, ": ", problem));
    };
    if (dims.num_attention_heads() % tp != 0 || dims.num_kv_heads() % tp != 0) {
      return refuse("tensor_parallel",
                    absl::StrCat(tp, " does not divide the model's ", dims.num_attention_heads(),
                                 " attention heads and ", dims.num_kv_heads(),
                                 " key/value heads (key/value heads are split, not replicated)"));
    }
    if (dims.ffn_hidden_size() % tp != 0) {
      return refuse("tensor_parallel",
                    absl::StrCat(tp, " does not divide ffn_hidden_size ", dims.ffn_hidden_size()));
    }
    if (dims.num_layers() % pp != 0) {
      return refuse("pipeline_parallel", absl::StrCat(pp, " does not divide the model's ",
                                                      dims.num_layers(), " layers"));
    }
    if (task_.plan().layout().sequence_parallel() && spec_.data().seq_len() % tp != 0) {
      return refuse("sequence_parallel", absl::StrCat("data.seq_len ", spec_.data().seq_len(),
                                                      " is not divisible by tensor_parallel ", tp));
    }
    return absl::OkStatus();
  }

  v1::ActivationCheckpointing CheckpointingMode() const {
    const v1::Layout& layout = task_.plan().layout();
    if (layout.activation_checkpointing_mode() != v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED) {
      return layout.activation_checkpointing_mode();
    }
    return layout.activation_checkpointing() ? v1::ACTIVATION_CHECKPOINTING_FULL
                                             : v1::ACTIVATION_CHECKPOINTING_NONE;
  }

  absl::Status SetupDevice() {
    bool cuda = assignment_.device_type() == v1::DEVICE_TYPE_CUDA;
    if (cuda) {
#if TESSERA_WITH_CUDA
      if (!torch::cuda::is_available()) {
        return absl::FailedPreconditionError("device_type CUDA: no CUDA device is visible");
      }
      int index = assignment_.gpu_index() >= 0 ? assignment_.gpu_index() : assignment_.local_rank();
      device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
      device_name_ = at::cuda::getDeviceProperties(index)->name;
#else
      return absl::FailedPreconditionError(
          "device_type CUDA: this trainer was built without CUDA (TESSERA_WITH_CUDA=OFF)");
#endif
    } else {
      device_ = torch::Device(torch::kCPU);
      device_name_ = "cpu";
    }
    v1::Precision precision = spec_.precision();
    if (precision == v1::PRECISION_UNSPECIFIED) {
      precision = cuda ? v1::PRECISION_BF16 : v1::PRECISION_FP32;
    }
    if (precision == v1::PRECISION_BF16 && !cuda) {
      return absl::InvalidArgumentError("precision: BF16 needs a CUDA device; use FP32 on CPU");
    }
    bf16_ = precision == v1::PRECISION_BF16;
    return absl::OkStatus();
  }

  absl::Status Setup() {
    if (auto status = ValidateLayout(); !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }
    auto summary = planner::ResolveModel(spec_.model(), spec_.data().seq_len());
    if (!summary.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, summary.status());
    summary_ = *summary;
    if (auto status = ValidateSplits(); !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }
    if (auto status = SetupDevice(); !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }

    auto dataset =
        TokenDataset::Open({spec_.data().train_shards().begin(), spec_.data().train_shards().end()},
                           spec_.data().seq_len());
    if (!dataset.ok()) return Fail(v1::FAILURE_KIND_DATA_ERROR, dataset.status());
    dataset_.emplace(std::move(*dataset));
    if (dataset_->vocab_size() > static_cast<uint32_t>(summary_.dims().vocab_size())) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC,
                  absl::InvalidArgumentError(absl::StrCat(
                      "data.train_shards: tokenizer vocabulary ", dataset_->vocab_size(),
                      " is larger than the model's vocab_size ", summary_.dims().vocab_size())));
    }

    if (auto status = ResolveMaxSteps(); !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }
    if (auto status = planner::ValidateSchedule(spec_.optimizer().schedule(), max_steps_);
        !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }

    if (spec_.data().validation_shards_size() > 0 && spec_.data().eval_interval_steps() > 0) {
      auto validation = TokenDataset::Open(
          {spec_.data().validation_shards().begin(), spec_.data().validation_shards().end()},
          spec_.data().seq_len(), "data.validation_shards");
      if (!validation.ok()) return Fail(v1::FAILURE_KIND_DATA_ERROR, validation.status());
      validation_.emplace(std::move(*validation));
    }

    if (world() > 1) {
      absl::Duration timeout = task_.collective_timeout_seconds() > 0
                                   ? absl::Seconds(task_.collective_timeout_seconds())
                                   : options_.collective_timeout;
      auto group = JoinProcessGroup(assignment_, {.timeout = timeout});
      if (!group.ok()) {
        // AlreadyExists: rank 0 found the master port taken (distributed.h).
        return Fail(absl::IsAlreadyExists(group.status()) ? v1::FAILURE_KIND_RENDEZVOUS
                                                          : v1::FAILURE_KIND_COLLECTIVE_TIMEOUT,
                    group.status());
      }
      group_.emplace(std::move(*group));
    }
    auto mesh = DeviceMesh::Create(shape_, rank(), group_.has_value() ? &*group_ : nullptr,
                                   {.timeout = options_.collective_timeout});
    if (!mesh.ok()) return Fail(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, mesh.status());
    mesh_ = *std::move(mesh);

    seed_ = spec_.seed() != 0 ? spec_.seed() : 1234;
    torch::manual_seed(seed_);
    double init_std = spec_.model().init_std() > 0 ? spec_.model().init_std() : 0.02;
    const int stage = mesh_.coord(MeshDim::kPipeline), stages = shape_.pp;
    const int layers_per_stage = summary_.dims().num_layers() / stages;
    // ZeRO-3 builds the model without memory; the engine gives each rank its shards only.
    const bool deferred = task_.plan().layout().zero_stage() == 3 && !spec_.has_lora();
    TensorParallel tp{
        .group = mesh_.group(MeshDim::kTensor),
        .rank = mesh_.coord(MeshDim::kTensor),
        .size = shape_.tp,
        .sequence_parallel = shape_.tp > 1 && task_.plan().layout().sequence_parallel()};
    model_ = CausalLM(summary_.dims(), init_std,
                      ModelPartition{.tp = tp,
                                     .first_layer = stage * layers_per_stage,
                                     .num_layers = layers_per_stage,
                                     .embedding = stage == 0,
                                     .head = stage == stages - 1},
                      deferred ? ParameterStorage::kDeferred : ParameterStorage::kInitialized);
    auto pretrained_error = [](const absl::Status& status) {
      return absl::Status(status.code(), absl::StrCat("model.from_pretrained: ", status.message()));
    };
    // Where the deferred model's shards come from.
    ParameterValues initial_values = [model = model_](const std::string& name) {
      return absl::StatusOr<at::Tensor>(model->InitialValue(name));
    };
    if (spec_.model().has_from_pretrained()) {
      // Every rank reads its own part; a resumed checkpoint then overrides these weights.
      absl::Status status;
      if (deferred) {
        auto values = HfWeightValues(*model_, spec_.model().from_pretrained());
        status = values.status();
        if (values.ok()) initial_values = *std::move(values);
      } else {
        status = LoadHfWeights(*model_, spec_.model().from_pretrained());
      }
      if (!status.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, pretrained_error(status));
    }
    if (spec_.has_lora()) {
      auto lora = planner::ResolveLora(spec_.lora(), summary_.dims());
      if (!lora.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, lora.status());
      lora_ = *std::move(lora);
      model_->AddLora(LoraOptionsOf(*lora_));
    }
    model_->MoveTo(device_);
    if (lora_.has_value() && bf16_) {
      // The frozen base is only read: held in the compute precision it halves its memory, as the
      // planner's LoRA model assumes. The adapters stay float32 for AdamW.
      torch::NoGradGuard no_grad;
      for (auto& param : model_->parameters()) {
        if (!param.requires_grad()) param.set_data(param.to(torch::kBFloat16));
      }
    }
    model_->SetActivationCheckpointing(CheckpointingMode());
    // Deferred shards are drawn from the same seed (or read from the same files) on every rank.
    if (!deferred) BroadcastParameters();
    if (stages > 1) {
      const int64_t seq = spec_.data().seq_len() / (tp.sequence_parallel ? tp.size : 1);
      std::vector<int> stage_ranks;
      for (int s = 0; s < stages; ++s) {
        stage_ranks.push_back(DeviceMesh::RankAt(
            shape_, {s, mesh_.coord(MeshDim::kData), mesh_.coord(MeshDim::kTensor)}));
      }
      pipeline_.emplace(mesh_.group(MeshDim::kPipeline), stage, std::move(stage_ranks),
                        std::vector<int64_t>{spec_.batch().micro_batch_size(), seq,
                                             summary_.dims().hidden_size()},
                        device_);
    }
    const v1::OptimizerSpec& opt = spec_.optimizer();
    engine_ = std::make_unique<ShardedEngine>(
        model_, ShardedEngineOptions{.zero_stage = task_.plan().layout().zero_stage(),
                                     .dp_group = mesh_.group(MeshDim::kData),
                                     .dp_rank = mesh_.coord(MeshDim::kData),
                                     .dp_size = mesh_.size(MeshDim::kData),
                                     .adamw = {.beta1 = opt.beta1() > 0 ? opt.beta1() : 0.9,
                                               .beta2 = opt.beta2() > 0 ? opt.beta2() : 0.95,
                                               .eps = opt.epsilon() > 0 ? opt.epsilon() : 1e-8},
                                     .weight_decay = opt.weight_decay(),
                                     .bf16 = bf16_,
                                     .sharded_collectives_as_all_reduce = !device_.is_cuda(),
                                     .tp = tp,
                                     .world_group = group_.has_value() ? group_->group : nullptr,
                                     .pp_group = mesh_.group(MeshDim::kPipeline),
                                     .pp_stage = stage,
                                     .pp_size = stages,
                                     .cuda_graphs = options_.cuda_graphs,
                                     .device = device_});

    checkpointer_.emplace(Checkpoints());
    v1::DataPosition start;
    start.set_seed(seed_);
    if (auto status = Resume(&start); !status.ok()) {
      return Fail(v1::FAILURE_KIND_CHECKPOINT_ERROR, status);
    }
    // A resumed checkpoint covers every element of the shards (ResumeLatest refuses holes), so
    // the deferred shards are drawn or read only for a fresh start.
    if (deferred && result_.resumed_from.empty()) {
      if (auto status = engine_->InitializeShards(initial_values); !status.ok()) {
        return spec_.model().has_from_pretrained()
                   ? Fail(v1::FAILURE_KIND_INVALID_SPEC, pretrained_error(status))
                   : Fail(v1::FAILURE_KIND_INTERNAL, status);
      }
    }
    if (options_.progress != nullptr) options_.progress->SetStep(step_);
    auto loader = BatchLoader::Create(&*dataset_,
                                      {.global_batch_size = spec_.batch().global_batch_size(),
                                       .micro_batch_size = spec_.batch().micro_batch_size(),
                                       .dp_rank = mesh_.coord(MeshDim::kData),
                                       .dp_size = mesh_.size(MeshDim::kData),
                                       .seed = seed_},
                                      start);
    if (!loader.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, loader.status());
    loader_.emplace(std::move(*loader));

    result_.start_step = step_;

    v1::TrainerReport report = NewReport();
    v1::TrainerStarted* started = report.mutable_started();
    started->set_start_step(step_);
    started->set_num_parameters(summary_.num_parameters());
    started->set_device(device_.is_cuda() ? absl::StrCat(device_.str(), " (", device_name_, ")")
                                          : std::string("cpu"));
    started->set_backend(group_.has_value() ? group_->backend
                                            : (device_.is_cuda() ? "nccl" : "gloo"));
    started->set_resumed_from(result_.resumed_from);
    Send(report);
    const EngineMemory memory = engine_->Memory();
    Log(absl::StrFormat(
        "model %s: %d parameters; %d rank(s) on %s (%s); ZeRO %d, activation checkpointing %s; "
        "%d micro-batch(es) per step; this rank holds %.1f MiB of parameters, %.1f MiB of "
        "gradients, %.1f MiB of optimizer state",
        summary_.preset().empty() ? "custom" : summary_.preset(), summary_.num_parameters(),
        world(), device_.str(), mesh_.Describe(), task_.plan().layout().zero_stage(),
        absl::AsciiStrToLower(absl::StripPrefix(
            v1::ActivationCheckpointing_Name(CheckpointingMode()), "ACTIVATION_CHECKPOINTING_")),
        loader_->accumulation_steps(), memory.parameter_bytes / 1048576.0,
        memory.gradient_bytes / 1048576.0,
        (memory.moment_bytes + memory.step_counter_bytes) / 1048576.0));
    if (lora_.has_value()) {
      Log(absl::StrFormat(
          "LoRA rank %d, alpha %g, dropout %g on %s: %d trainable parameters (%.3f%%), %.1f MiB "
          "of frozen weights",
          lora_->rank, lora_->alpha, lora_->dropout,
          absl::StrJoin(lora_->peft_target_modules, ", "),
          lora_->parameters_per_layer * summary_.dims().num_layers(),
          100.0 * lora_->parameters_per_layer * summary_.dims().num_layers() /
              summary_.num_parameters(),
          memory.frozen_bytes / 1048576.0));
    }
    return absl::OkStatus();
  }

  // max_steps, or what spec.epochs come to over the training samples.
  absl::Status ResolveMaxSteps() {
    samples_per_epoch_ = dataset_->num_samples();
    if (spec_.epochs() <= 0) {
      max_steps_ = spec_.max_steps();
      return absl::OkStatus();
    }
    const int64_t batch = spec_.batch().global_batch_size();
    if (samples_per_epoch_ <= 0 || batch <= 0) {
      return absl::InvalidArgumentError("epochs: the training shards hold no sample");
    }
    const double steps =
        std::ceil(spec_.epochs() * static_cast<double>(samples_per_epoch_) / batch - 1e-9);
    if (!(steps >= 1) || steps > 1e12) {
      return absl::InvalidArgumentError(absl::StrCat("epochs: ", spec_.epochs(), " x ",
                                                     samples_per_epoch_, " samples / batch ",
                                                     batch, " is not a step count"));
    }
    max_steps_ = static_cast<int64_t>(steps);
    Log(absl::StrFormat("%g epoch(s) of %d samples at %d per step: %d steps", spec_.epochs(),
                        samples_per_epoch_, batch, max_steps_));
    return absl::OkStatus();
  }

  void BroadcastParameters() {
    const auto& dp_group = mesh_.group(MeshDim::kData);
    if (!dp_group) return;
    // Every rank initialises from the same seed; the broadcast makes dp rank 0's weights
    // authoritative anyway, as DDP does (the ranks of a dp group hold the same shard).
    for (auto& param : model_->parameters()) {
      // Frozen weights (LoRA's base) are the same everywhere: loaded from one source or drawn
      // from one seed.
      if (!param.requires_grad()) continue;
      std::vector<at::Tensor> tensors{param.data()};
      dp_group->broadcast(tensors)->wait();
    }
  }

  absl::Status Resume(v1::DataPosition* start) {
    ASSIGN_OR_RETURN(std::optional<Resumed> resumed, ResumeLatest(Checkpoints()));
    if (!resumed.has_value()) return absl::OkStatus();
    step_ = resumed->manifest.step();
    tokens_seen_ = resumed->manifest.tokens_seen();
    *start = resumed->manifest.data_position();
    result_.resumed_from = resumed->path;
    return absl::OkStatus();
  }

  CheckpointContext Checkpoints() {
    return {.task = &task_,
            .rank = rank(),
            .world = world(),
            .group = group_.has_value() ? &*group_ : nullptr,
            .engine = engine_.get(),
            .log = options_.log,
            .kill_in_checkpoint_at_step = options_.kill_in_checkpoint_at_step};
  }

  at::Tensor ToDevice(std::vector<int64_t>& values, int batch, int seq) {
    return torch::from_blob(values.data(), {batch, seq}, torch::kInt64).to(device_, true);
  }

  // The micro-batch's positions in their records on the device; undefined without records.
  at::Tensor PositionsOf(MicroBatch& mb, int seq) {
    return mb.positions.empty() ? at::Tensor() : ToDevice(mb.positions, mb.batch_size, seq);
  }

  // One optimizer step; returns the step's loss averaged over ranks.
  absl::StatusOr<double> TrainStep(double learning_rate, double* grad_norm) {
    std::vector<MicroBatch> micro_batches = loader_->NextStep();
    const int accumulation = static_cast<int>(micro_batches.size());
    // The step's loss is the sum of every counted target's loss over the global batch (all
    // micro-batches, all dp ranks) divided by their number. A micro-batch's mean loss therefore
    // weighs LossWeight() = its counted targets / the step's, both in its loss and in its
    // gradient, so that the dp group's summed gradient is that of the global batch however the
    // loss mask spreads the counted targets (1 / (accumulation * dp) without a mask).
    at::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(device_));
    if (pipeline_.has_value()) {
      pipeline_->Train(
          accumulation,
          [&](int i, const at::Tensor& input) {
            MicroBatch& mb = micro_batches[i];
            at::Tensor output = engine_->ForwardStage(
                pipeline_->first() ? ToDevice(mb.inputs, mb.batch_size, mb.seq_len) : input,
                pipeline_->last() ? ToDevice(mb.targets, mb.batch_size, mb.seq_len) : at::Tensor(),
                PositionsOf(mb, mb.seq_len));
            if (pipeline_->last()) {
              step_loss += output.detach().to(torch::kFloat32) * LossWeight(mb);
            }
            return output;
          },
          [&](int i, const at::Tensor& output, const at::Tensor& grad, bool last) {
            engine_->BackwardStage(output, grad, LossWeight(micro_batches[i]), last);
          });
    } else {
      for (int i = 0; i < accumulation; ++i) {
        MicroBatch& mb = micro_batches[i];
        at::Tensor inputs = ToDevice(mb.inputs, mb.batch_size, mb.seq_len);
        at::Tensor targets = ToDevice(mb.targets, mb.batch_size, mb.seq_len);
        const double weight = LossWeight(mb);
        at::Tensor loss =
            engine_->ForwardBackward(inputs, targets, weight,
                                     /*last=*/i == accumulation - 1, PositionsOf(mb, mb.seq_len));
        step_loss += loss.to(torch::kFloat32) * weight;
      }
    }
    if (group_.has_value()) {
      // The last pipeline stage's ranks hold the weighted losses, every tp rank the same value;
      // the weights already divide by the dp group's counted targets.
      std::vector<at::Tensor> tensors{step_loss};
      WaitForPeers(group_->group->allreduce(tensors));
      step_loss = tensors[0] / shape_.tp;
    }
    double loss_value = step_loss.item<double>();
    if (options_.nan_loss_from_step > 0 && step_ + 1 >= options_.nan_loss_from_step) {
      loss_value = std::numeric_limits<double>::quiet_NaN();
    }
    if (!std::isfinite(loss_value)) {
      // The step is reported (its loss gauge reads NaN, for dashboards and alerts), never applied.
      if (rank() == 0) {
        v1::TrainerReport report = NewReport();
        v1::StepMetrics* m = report.mutable_metrics();
        m->set_step(step_ + 1);
        m->set_loss(loss_value);
        m->set_learning_rate(learning_rate);
        *m->mutable_time() = report.time();
        Send(report);
      }
      return absl::InternalError(absl::StrCat("loss is ", loss_value, " at step ", step_ + 1));
    }
    // A save started after the last step may still be copying the state the optimizer changes.
    checkpoint_blocked_seconds_ += checkpointer_->AwaitSnapshot();
    double clip = spec_.optimizer().grad_clip_norm();
    // A global batch without a counted target (every target masked) has nothing to learn from:
    // AdamW would still move the weights by its momentum and decay. Every rank counts the same
    // step total from the masks, so all of them skip together.
    const bool update = micro_batches.empty() || micro_batches.front().step_loss_tokens > 0;
    if (!update) {
      Log(absl::StrCat("step ", step_ + 1,
                       ": no counted target in the global batch (every target masked); "
                       "the optimizer step is skipped"));
    }
    *grad_norm = engine_->Step(
        learning_rate, clip > 0 ? clip : std::numeric_limits<double>::infinity(), update);
    return loss_value;
  }

  int64_t PeakMemoryBytes() {
#if TESSERA_WITH_CUDA
    if (device_.is_cuda()) {
      auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      int64_t peak = stats.allocated_bytes[0].peak;
      c10::cuda::CUDACachingAllocator::resetPeakStats(device_.index());
      return peak;
    }
#endif
    return PeakHostMemoryBytes();
  }

  // Mean loss over the counted targets of the first eval_batches x micro_batch x ranks validation
  // samples (the same ones every time, so evaluations compare), each rank
  // taking its share; rank 0 reports it.
  void Evaluate() {
    torch::NoGradGuard no_grad;
    model_->eval();
    const int micro = spec_.batch().micro_batch_size();
    const int seq = spec_.data().seq_len();
    const int batches = spec_.data().eval_batches() > 0 ? spec_.data().eval_batches() : 20;
    const int64_t available = validation_->num_samples();
    at::Tensor totals = torch::zeros({2}, torch::TensorOptions().dtype(torch::kFloat64));
    for (int b = 0; b < batches; ++b) {
      MicroBatch mb;
      mb.seq_len = seq;
      for (int i = 0; i < micro; ++i) {
        int64_t index =
            (static_cast<int64_t>(b) * mesh_.size(MeshDim::kData) + mesh_.coord(MeshDim::kData)) *
                micro +
            i;
        if (index >= available) break;
        mb.inputs.resize(mb.inputs.size() + seq);
        mb.targets.resize(mb.targets.size() + seq);
        if (validation_->has_record_starts()) mb.positions.resize(mb.inputs.size());
        mb.loss_tokens += validation_->ReadExample(
            index, mb.inputs.data() + mb.inputs.size() - seq,
            mb.targets.data() + mb.targets.size() - seq,
            mb.positions.empty() ? nullptr : mb.positions.data() + mb.positions.size() - seq);
        ++mb.batch_size;
      }
      if (mb.batch_size == 0) break;
      at::Tensor loss;
      if (pipeline_.has_value()) {
        // Evaluation batches may be smaller than a micro-batch: fixed-shape sends need full ones.
        if (mb.batch_size != micro) break;
        loss = pipeline_->Evaluate([&](int, const at::Tensor& input) {
          return engine_->ForwardStage(
              pipeline_->first() ? ToDevice(mb.inputs, mb.batch_size, seq) : input,
              pipeline_->last() ? ToDevice(mb.targets, mb.batch_size, seq) : at::Tensor(),
              PositionsOf(mb, seq));
        });
        if (!loss.defined()) continue;  // only the last stage counts
      } else {
        loss = engine_->EvalLoss(ToDevice(mb.inputs, mb.batch_size, seq),
                                 ToDevice(mb.targets, mb.batch_size, seq), PositionsOf(mb, seq));
      }
      // Each tp rank holds the same loss: one of them counts it.
      if (mesh_.coord(MeshDim::kTensor) != 0) continue;
      // The batch's loss is the mean over its counted targets.
      totals[0] += loss.item<double>() * static_cast<double>(mb.loss_tokens);
      totals[1] += static_cast<double>(mb.loss_tokens);
    }
    model_->train();
    if (group_.has_value()) {
      std::vector<at::Tensor> tensors{totals};
      group_->group->allreduce(tensors)->wait();
    }
    if (rank() != 0 || totals[1].item<double>() == 0) return;
    double loss = totals[0].item<double>() / totals[1].item<double>();
    v1::TrainerReport report = NewReport();
    v1::EvalMetrics* eval = report.mutable_eval();
    eval->set_step(step_);
    eval->set_loss(loss);
    eval->set_perplexity(std::exp(loss));
    eval->set_tokens(static_cast<int64_t>(totals[1].item<double>()));
    Send(report);
  }

  absl::Status TrainLoop(v1::FailureKind* kind) {
    const int64_t max_steps = max_steps_;
    const int64_t tokens_per_step = spec_.batch().global_batch_size() * spec_.data().seq_len();
    const int64_t interval = spec_.checkpoint().interval_steps();
    const double peak_flops = PeakFlopsForDevice(device_name_);
    // Model FLOPs per token (MFU's numerator): with LoRA the frozen base computes no weight
    // gradients, 2N fewer per token (the planner's LoRA model).
    const double flops_per_token =
        summary_.flops_per_token() - (lora_.has_value() ? 2.0 * summary_.num_parameters() : 0.0);
    StepProfiler profiler(options_.profile, rank(), device_.is_cuda());
    while (step_ < max_steps) {
      profiler.BeforeStep(step_ + 1);
      auto start = std::chrono::steady_clock::now();
      const double waited_before = PeerWaitSeconds();
      double lr = planner::LearningRateAt(spec_.optimizer().schedule(), max_steps, step_ + 1);
      double grad_norm = 0;
      absl::StatusOr<double> loss;
      {
        // Marks the step in a profile (--profile_dir); costs nothing without one.
        RECORD_USER_SCOPE("train_step");
        loss = TrainStep(lr, &grad_norm);
      }
      if (!loss.ok()) {
        *kind = v1::FAILURE_KIND_NAN_LOSS;
        return loss.status();
      }
      if (const std::string graphs = engine_->CudaGraphStatus(); graphs != graph_status_logged_) {
        Log(absl::StrCat("CUDA graphs: ", graphs));
        graph_status_logged_ = graphs;
      }
      ++step_;
      tokens_seen_ += tokens_per_step;
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (options_.progress != nullptr) {
        const double busy = std::max(0.0, seconds - (PeerWaitSeconds() - waited_before));
        options_.progress->StepFinished(step_, seconds, busy);
      }
      result_.final_loss = *loss;
      // Reported with this step, then counted afresh.
      const double blocked_before = checkpoint_blocked_seconds_;
      if (rank() == 0) {
        v1::TrainerReport report = NewReport();
        v1::StepMetrics* m = report.mutable_metrics();
        m->set_step(step_);
        m->set_loss(*loss);
        m->set_grad_norm(grad_norm);
        m->set_learning_rate(lr);
        m->set_step_time_seconds(seconds);
        m->set_tokens_per_second(tokens_per_step / seconds);
        m->set_samples_per_second(spec_.batch().global_batch_size() / seconds);
        m->set_mfu(peak_flops > 0 ? flops_per_token * (tokens_per_step / seconds) /
                                        (world() * peak_flops)
                                  : 0.0);
        m->set_peak_memory_bytes(PeakMemoryBytes());
        m->set_tokens_seen(tokens_seen_);
        m->set_max_steps(max_steps);
        m->set_checkpoint_blocked_seconds(checkpoint_blocked_seconds_);
        m->set_epoch(static_cast<double>(step_) * spec_.batch().global_batch_size() /
                     static_cast<double>(samples_per_epoch_));
        *m->mutable_time() = report.time();
        Send(report);
      }
      checkpoint_blocked_seconds_ -= blocked_before;
      bool last = step_ == max_steps;
      // Before evaluation and checkpoints, so that the trace holds training steps only.
      if (absl::StatusOr<std::string> trace = profiler.AfterStep(step_, last); !trace.ok()) {
        Log(absl::StrCat("profile not written: ", trace.status().message()));
      } else if (!trace->empty()) {
        Log(absl::StrCat("profile of steps ", options_.profile.first_step, " to ", step_,
                         " written to ", *trace));
      }
      const int64_t eval_interval = spec_.data().eval_interval_steps();
      if (validation_.has_value() && (last || step_ % eval_interval == 0)) Evaluate();
      const bool periodic = interval > 0 && step_ % interval == 0;
      if (!task_.checkpoint_directory().empty() && (last || periodic)) {
        if (auto status = SaveCheckpoint(last); !status.ok()) {
          *kind = v1::FAILURE_KIND_CHECKPOINT_ERROR;
          return status;
        }
      }
      if (!last && StopAgreed()) {
        // This step's checkpoint, committed before the exit: the job resumes from it elsewhere.
        if (!task_.checkpoint_directory().empty()) {
          absl::Status saved =
              periodic ? checkpointer_->Wait() : SaveCheckpoint(/*last=*/false, /*wait=*/true);
          if (!saved.ok()) {
            *kind = v1::FAILURE_KIND_CHECKPOINT_ERROR;
            return saved;
          }
        }
        result_.stopped = true;
        break;
      }
    }
    result_.final_step = step_;
    return absl::OkStatus();
  }

  // Whether any rank was asked to checkpoint and stop (TrainOptions::stop_requested): every
  // rank takes part after every step, so that all stop after the same one.
  bool StopAgreed() {
    if (options_.stop_requested == nullptr) return false;
    const bool asked = options_.stop_requested->load(std::memory_order_relaxed);
    if (!group_.has_value()) return asked;
    // On the CPU (Gloo, also beside NCCL): no device synchronisation for one flag.
    std::vector<at::Tensor> flag{torch::full({1}, asked ? 1 : 0, torch::kInt32)};
    group_->group->allreduce(flag)->wait();
    return flag[0].item<int32_t>() > 0;
  }

  // Starts the checkpoint of this step in the background (AsyncCheckpointer); the last one (and
  // one asked to `wait`) is waited for, so the job ends with it committed (and, with LoRA, the
  // last one's PEFT adapter written).
  absl::Status SaveCheckpoint(bool last, bool wait = false) {
    CheckpointState state{.step = step_,
                          .tokens_seen = tokens_seen_,
                          .layout = task_.plan().layout(),
                          .model = summary_,
                          .data_position = loader_->position()};
    state.layout.set_data_parallel(mesh_.size(MeshDim::kData));
    state.layout.set_tensor_parallel(mesh_.size(MeshDim::kTensor));
    state.layout.set_pipeline_parallel(mesh_.size(MeshDim::kPipeline));
    auto committed = std::make_shared<v1::Checkpoint>();
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(checkpointer_->Start(
        state, last && spec_.checkpoint().export_safetensors(),
        [this, wait = last || wait, committed](const v1::Checkpoint& checkpoint) {
          // Rank 0's background thread; a waited-for checkpoint is reported after the wait below.
          if (wait) {
            *committed = checkpoint;
            return;
          }
          v1::TrainerReport report = NewReport();
          *report.mutable_checkpoint() = checkpoint;
          Send(report);
        }));
    if (!last && !wait) {
      checkpoint_blocked_seconds_ += checkpointer_->last_blocked_seconds();
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(checkpointer_->Wait());
    checkpoint_blocked_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank() != 0) return absl::OkStatus();
    if (last && lora_.has_value()) {
      // Rank 0 holds every adapter (LoRA runs without tensor or pipeline splits).
      const std::string dir = absl::StrCat(committed->path(), "/adapter");
      RETURN_IF_ERROR(ExportPeftAdapter(*model_, *lora_, dir, spec_.model().from_pretrained()));
      Log(absl::StrCat("LoRA adapter in PEFT's layout: ", dir));
    }
    v1::TrainerReport report = NewReport();
    *report.mutable_checkpoint() = *committed;
    Send(report);
    return absl::OkStatus();
  }

  const v1::TrainerTask& task_;
  const v1::JobSpec& spec_;
  const v1::RankAssignment& assignment_;
  Reporter& reporter_;
  TrainOptions options_;

  v1::FailureKind setup_kind_ = v1::FAILURE_KIND_INTERNAL;
  v1::ModelSummary summary_;
  torch::Device device_{torch::kCPU};
  std::string device_name_;
  bool bf16_ = false;
  uint64_t seed_ = 0;
  std::optional<TokenDataset> dataset_;
  // Held-out samples for evaluation; empty when the job asks for none.
  std::optional<TokenDataset> validation_;
  std::optional<BatchLoader> loader_;
  std::optional<JoinedGroup> group_;
  CausalLM model_{nullptr};
  // LoRA fine-tuning (spec.lora), resolved.
  std::optional<planner::ResolvedLora> lora_;
  MeshShape shape_;
  DeviceMesh mesh_;
  std::unique_ptr<ShardedEngine> engine_;
  // The engine's CudaGraphStatus() as last logged.
  std::string graph_status_logged_;
  // Background checkpoint writes (after engine_: destroyed first, waiting for its save).
  std::optional<AsyncCheckpointer> checkpointer_;
  double checkpoint_blocked_seconds_ = 0;
  // Pipeline parallelism only.
  std::optional<PipelineSchedule> pipeline_;
  int64_t step_ = 0;
  int64_t max_steps_ = 0;
  int64_t samples_per_epoch_ = 1;
  int64_t tokens_seen_ = 0;
  TrainResult result_;
};

}  // namespace

double PeakFlopsForDevice(const std::string& device_name) {
  if (device_name.empty() || device_name == "cpu") return 0;
  auto device = planner::DeviceForGpuName(device_name, 0);
  return device.ok() ? device->peak_flops_bf16() : 0;
}

absl::StatusOr<TrainResult> RunTraining(const v1::TrainerTask& task, Reporter& reporter,
                                        const TrainOptions& options) {
  Trainer trainer(task, reporter, options);
  return trainer.Run();
}

}  // namespace tessera::trainer
