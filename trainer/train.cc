#include "trainer/train.h"

#include <ATen/autocast_mode.h>
#include <sys/resource.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/serialize.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/timestamp.h"
#include "google/protobuf/util/time_util.h"
#include "planner/devices.h"
#include "planner/lr_schedule.h"
#include "planner/model_config.h"
#include "trainer/adamw.h"
#include "trainer/checkpoint.h"
#include "trainer/data_loader.h"
#include "trainer/distributed.h"
#include "trainer/model.h"
#include "trainer/safetensors.h"
#include "trainer/torch_pch.h"
#include "trainer/training_state.h"
#if TESSERA_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace tessera::trainer {
namespace {

using google::protobuf::util::TimeUtil;

// Bucket sizes of the gradient all-reduce, as PyTorch's DDP defaults: a small
// first bucket so communication starts early in backward, then 25 MiB.
constexpr size_t kFirstBucketBytes = 1 << 20;
constexpr size_t kBucketBytes = 25 << 20;
// TCPStore key through which rank 0 tells the others what to resume from.
constexpr char kResumeKey[] = "tessera/resume_from";

v1::FailureKind ClassifyTorchError(const std::string& what) {
  if (absl::StrContains(what, "out of memory") || absl::StrContains(what, "OutOfMemory")) {
    return v1::FAILURE_KIND_OUT_OF_MEMORY;
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

// Enables bf16 autocast on CUDA for its lifetime.
class AutocastScope {
 public:
  explicit AutocastScope(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~AutocastScope() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }

 private:
  bool enabled_;
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
    } catch (const c10::Error& e) {
      kind = ClassifyTorchError(e.what());
      status = absl::InternalError(absl::StrCat("LibTorch: ", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      kind = ClassifyTorchError(e.what());
      status = absl::InternalError(e.what());
    }
    if (!status.ok()) {
      ReportFailure(kind, status);
      return status;
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
    Send(report);
    Log(absl::StrCat("failed: ", status.ToString()));
  }

  absl::Status Fail(v1::FailureKind kind, absl::Status status) {
    setup_kind_ = kind;
    return status;
  }

  absl::Status ValidateLayout() {
    const v1::Layout& layout = task_.plan().layout();
    int tp = std::max(1, layout.tensor_parallel()), pp = std::max(1, layout.pipeline_parallel());
    int dp = layout.data_parallel() > 0 ? layout.data_parallel() : world();
    if (tp != 1 || pp != 1 || layout.zero_stage() != 0) {
      return absl::UnimplementedError(absl::StrFormat(
          "parallelism.layout: tensor_parallel %d, pipeline_parallel %d, zero_stage %d: this "
          "trainer runs data parallel only (tp=1, pp=1, zero_stage=0) so far",
          tp, pp, layout.zero_stage()));
    }
    if (dp != world()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parallelism.layout.data_parallel ", dp, " != world size ", world()));
    }
    return absl::OkStatus();
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
    if (auto status = planner::ValidateSchedule(spec_.optimizer().schedule(), spec_.max_steps());
        !status.ok()) {
      return Fail(v1::FAILURE_KIND_INVALID_SPEC, status);
    }
    auto summary = planner::ResolveModel(spec_.model(), spec_.data().seq_len());
    if (!summary.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, summary.status());
    summary_ = *summary;
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
      if (!group.ok()) return Fail(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, group.status());
      group_.emplace(std::move(*group));
    }

    seed_ = spec_.seed() != 0 ? spec_.seed() : 1234;
    torch::manual_seed(seed_);
    double init_std = spec_.model().init_std() > 0 ? spec_.model().init_std() : 0.02;
    model_ = CausalLM(summary_.dims(), init_std);
    model_->to(device_);
    params_ = model_->parameters();
    BroadcastParameters();

    const v1::OptimizerSpec& opt = spec_.optimizer();
    optimizer_.emplace(
        std::vector<AdamWGroup>{
            {.params = model_->DecayParameters(), .weight_decay = opt.weight_decay()},
            {.params = model_->NoDecayParameters(), .weight_decay = 0.0}},
        AdamWOptions{.beta1 = opt.beta1() > 0 ? opt.beta1() : 0.9,
                     .beta2 = opt.beta2() > 0 ? opt.beta2() : 0.95,
                     .eps = opt.epsilon() > 0 ? opt.epsilon() : 1e-8});

    v1::DataPosition start;
    start.set_seed(seed_);
    if (auto status = Resume(&start); !status.ok()) {
      return Fail(v1::FAILURE_KIND_CHECKPOINT_ERROR, status);
    }
    auto loader = BatchLoader::Create(&*dataset_,
                                      {.global_batch_size = spec_.batch().global_batch_size(),
                                       .micro_batch_size = spec_.batch().micro_batch_size(),
                                       .dp_rank = rank(),
                                       .dp_size = world(),
                                       .seed = seed_},
                                      start);
    if (!loader.ok()) return Fail(v1::FAILURE_KIND_INVALID_SPEC, loader.status());
    loader_.emplace(std::move(*loader));

    if (group_.has_value()) CreateReducer();
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
    Log(absl::StrFormat("model %s: %d parameters; %d rank(s) on %s; %d micro-batch(es) per step",
                        summary_.preset().empty() ? "custom" : summary_.preset(),
                        summary_.num_parameters(), world(), device_.str(),
                        loader_->accumulation_steps()));
    return absl::OkStatus();
  }

  void BroadcastParameters() {
    if (!group_.has_value()) return;
    // Every rank initialises from the same seed; the broadcast makes rank 0's
    // weights authoritative anyway, as DDP does.
    for (auto& param : params_) {
      std::vector<at::Tensor> tensors{param.data()};
      group_->group->broadcast(tensors)->wait();
    }
  }

  void CreateReducer() {
    std::vector<bool> sparse(params_.size(), false);
    auto [buckets, limits] =
        c10d::compute_bucket_assignment_by_size(params_, {kFirstBucketBytes, kBucketBytes}, sparse);
    // Gradients arrive in reverse order of the parameters' creation.
    std::reverse(buckets.begin(), buckets.end());
    std::reverse(limits.begin(), limits.end());
    std::vector<int64_t> limit_list(limits.begin(), limits.end());
    reducer_ = std::make_unique<c10d::Reducer>(
        params_, std::move(buckets), group_->group, sparse, static_cast<int64_t>(kBucketBytes),
        /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/false,
        std::unordered_map<size_t, std::string>(), static_cast<int64_t>(kFirstBucketBytes),
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false, limit_list);
  }

  absl::Status Resume(v1::DataPosition* start) {
    const std::string& root = task_.checkpoint_directory();
    bool resume = !spec_.checkpoint().has_resume() || spec_.checkpoint().resume();
    if (root.empty() || !resume) return absl::OkStatus();
    std::string path;
    std::optional<v1::CheckpointManifest> verified;
    if (rank() == 0) {
      std::vector<std::string> skipped;
      ASSIGN_OR_RETURN(auto found, FindLatestCheckpoint(root, &skipped));
      for (const auto& line : skipped) Log(absl::StrCat("skipping checkpoint: ", line));
      if (found.has_value()) {
        path = found->path;
        verified = std::move(found->manifest);
      }
    }
    if (group_.has_value()) {
      if (rank() == 0) {
        group_->store->set(kResumeKey, std::vector<uint8_t>(path.begin(), path.end()));
      } else {
        auto bytes = group_->store->get(kResumeKey);
        path.assign(bytes.begin(), bytes.end());
      }
    }
    if (path.empty()) return absl::OkStatus();

    // Rank 0 verified the checkpoint (every shard's sha256) while finding it; the others read
    // the manifest only.
    v1::CheckpointManifest manifest;
    if (verified.has_value()) {
      manifest = *std::move(verified);
    } else {
      ASSIGN_OR_RETURN(manifest, ReadManifest(path));
    }
    int shard_rank = manifest.layout().data_parallel() == world() ? rank() : 0;
    std::string shard = absl::StrCat(path, "/", ShardFileName(shard_rank));
    torch::serialize::InputArchive archive;
    archive.load_from(shard, device_);
    LoadTrainingState(archive, model_, *optimizer_);
    step_ = manifest.step();
    tokens_seen_ = manifest.tokens_seen();
    *start = manifest.data_position();
    result_.resumed_from = path;
    Log(absl::StrCat("resumed from ", path, " at step ", step_));
    return absl::OkStatus();
  }

  absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& dir) {
    std::ifstream in(absl::StrCat(dir, "/manifest.pb"), std::ios::binary);
    v1::CheckpointManifest manifest;
    if (!in || !manifest.ParseFromIstream(&in)) {
      return absl::DataLossError(absl::StrCat(dir, "/manifest.pb: cannot read"));
    }
    return manifest;
  }

  at::Tensor ToDevice(std::vector<int64_t>& values, int batch, int seq) {
    return torch::from_blob(values.data(), {batch, seq}, torch::kInt64).to(device_, true);
  }

  // One optimizer step; returns the step's loss averaged over ranks.
  absl::StatusOr<double> TrainStep(double learning_rate, double* grad_norm) {
    std::vector<MicroBatch> micro_batches = loader_->NextStep();
    const int accumulation = static_cast<int>(micro_batches.size());
    at::Tensor loss_sum = torch::zeros({}, torch::TensorOptions().device(device_));
    for (int i = 0; i < accumulation; ++i) {
      MicroBatch& mb = micro_batches[i];
      const bool sync = reducer_ != nullptr && i == accumulation - 1;
      if (sync) {
        reducer_->prepare_for_forward();
        reducer_->rebuild_buckets();
      }
      at::Tensor inputs = ToDevice(mb.inputs, mb.batch_size, mb.seq_len);
      at::Tensor targets = ToDevice(mb.targets, mb.batch_size, mb.seq_len);
      at::Tensor loss;
      {
        AutocastScope autocast(bf16_);
        loss = model_->Loss(inputs, targets);
      }
      at::Tensor scaled = loss / accumulation;
      if (sync) reducer_->prepare_for_backward({scaled});
      scaled.backward();
      loss_sum += loss.detach().to(torch::kFloat32);
    }
    at::Tensor step_loss = loss_sum / accumulation;
    if (group_.has_value()) {
      std::vector<at::Tensor> tensors{step_loss};
      group_->group->allreduce(tensors)->wait();
      step_loss = tensors[0] / world();
    }
    double loss_value = step_loss.item<double>();
    if (!std::isfinite(loss_value)) {
      return absl::InternalError(absl::StrCat("loss is ", loss_value, " at step ", step_ + 1));
    }
    double clip = spec_.optimizer().grad_clip_norm();
    *grad_norm = torch::nn::utils::clip_grad_norm_(
        params_, clip > 0 ? clip : std::numeric_limits<double>::infinity());
    optimizer_->Step(learning_rate);
    optimizer_->ZeroGrad();
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

  // Mean loss over the first eval_batches x micro_batch x ranks validation
  // samples (the same ones every time, so evaluations compare), each rank
  // taking its share; rank 0 reports it.
  void Evaluate() {
    torch::NoGradGuard no_grad;
    model_->eval();
    const int micro = spec_.batch().micro_batch_size();
    const int seq = spec_.data().seq_len();
    const int batches = spec_.data().eval_batches() > 0 ? spec_.data().eval_batches() : 20;
    const int64_t available = validation_->num_samples();
    std::vector<int64_t> window(seq + 1);
    at::Tensor totals = torch::zeros({2}, torch::TensorOptions().dtype(torch::kFloat64));
    for (int b = 0; b < batches; ++b) {
      MicroBatch mb;
      mb.seq_len = seq;
      for (int i = 0; i < micro; ++i) {
        int64_t index = (static_cast<int64_t>(b) * world() + rank()) * micro + i;
        if (index >= available) break;
        validation_->ReadSample(index, window.data());
        mb.inputs.insert(mb.inputs.end(), window.begin(), window.end() - 1);
        mb.targets.insert(mb.targets.end(), window.begin() + 1, window.end());
        ++mb.batch_size;
      }
      if (mb.batch_size == 0) break;
      AutocastScope autocast(bf16_);
      at::Tensor loss = model_->Loss(ToDevice(mb.inputs, mb.batch_size, seq),
                                     ToDevice(mb.targets, mb.batch_size, seq));
      int64_t tokens = static_cast<int64_t>(mb.batch_size) * seq;
      totals[0] += loss.item<double>() * tokens;
      totals[1] += static_cast<double>(tokens);
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
    const int64_t max_steps = spec_.max_steps();
    const int64_t tokens_per_step = spec_.batch().global_batch_size() * spec_.data().seq_len();
    const int64_t interval = spec_.checkpoint().interval_steps();
    const double peak_flops = PeakFlopsForDevice(device_name_);
    while (step_ < max_steps) {
      auto start = std::chrono::steady_clock::now();
      double lr = planner::LearningRateAt(spec_.optimizer().schedule(), max_steps, step_ + 1);
      double grad_norm = 0;
      auto loss = TrainStep(lr, &grad_norm);
      if (!loss.ok()) {
        *kind = v1::FAILURE_KIND_NAN_LOSS;
        return loss.status();
      }
      ++step_;
      tokens_seen_ += tokens_per_step;
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      result_.final_loss = *loss;
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
        m->set_mfu(peak_flops > 0 ? summary_.flops_per_token() * (tokens_per_step / seconds) /
                                        (world() * peak_flops)
                                  : 0.0);
        m->set_peak_memory_bytes(PeakMemoryBytes());
        m->set_tokens_seen(tokens_seen_);
        *m->mutable_time() = report.time();
        Send(report);
      }
      bool last = step_ == max_steps;
      const int64_t eval_interval = spec_.data().eval_interval_steps();
      if (validation_.has_value() && (last || step_ % eval_interval == 0)) Evaluate();
      if (!task_.checkpoint_directory().empty() &&
          (last || (interval > 0 && step_ % interval == 0))) {
        if (auto status = SaveCheckpoint(last); !status.ok()) {
          *kind = v1::FAILURE_KIND_CHECKPOINT_ERROR;
          return status;
        }
      }
    }
    result_.final_step = step_;
    return absl::OkStatus();
  }

  absl::Status SaveCheckpoint(bool last) {
    auto start = std::chrono::steady_clock::now();
    const std::string& root = task_.checkpoint_directory();
    if (rank() == 0) RETURN_IF_ERROR(PrepareStaging(root, step_).status());
    if (group_.has_value()) RETURN_IF_ERROR(Barrier(*group_));

    torch::serialize::OutputArchive archive;
    SaveTrainingState(model_, *optimizer_, archive);
    // Each rank hashes its shard while writing it and hands the digest to rank 0 through the
    // store, so the commit does not read the shards back.
    const std::string shard = ShardFileName(rank());
    ASSIGN_OR_RETURN(std::string sha256,
                     WriteHashedFile(absl::StrCat(StagingDir(root, step_), "/", shard),
                                     [&](const ByteSink& sink) { archive.save_to(sink); }));
    const std::string digest_key = absl::StrCat("checkpoint/", step_, "/sha256/");
    if (group_.has_value() && rank() != 0) {
      group_->store->set(absl::StrCat(digest_key, rank()),
                         std::vector<uint8_t>(sha256.begin(), sha256.end()));
    }
    if (group_.has_value()) RETURN_IF_ERROR(Barrier(*group_));
    if (rank() != 0) return absl::OkStatus();
    std::map<std::string, std::string> known_sha256{{shard, sha256}};
    for (int r = 1; r < world(); ++r) {
      std::vector<uint8_t> bytes = group_->store->get(absl::StrCat(digest_key, r));
      known_sha256[ShardFileName(r)] = std::string(bytes.begin(), bytes.end());
    }

    v1::CheckpointManifest manifest;
    manifest.set_job_id(task_.job_id());
    manifest.set_step(step_);
    *manifest.mutable_layout() = task_.plan().layout();
    manifest.mutable_layout()->set_data_parallel(world());
    *manifest.mutable_model() = summary_;
    *manifest.mutable_data_position() = loader_->position();
    manifest.set_tokens_seen(tokens_seen_);
    ASSIGN_OR_RETURN(manifest, CommitCheckpoint(root, step_, std::move(manifest), world(),
                                                spec_.checkpoint().keep_last(), known_sha256));
    std::string path = absl::StrCat(root, "/", CheckpointDirName(step_));

    v1::TrainerReport report = NewReport();
    v1::Checkpoint* checkpoint = report.mutable_checkpoint();
    checkpoint->set_job_id(task_.job_id());
    checkpoint->set_step(step_);
    checkpoint->set_path(path);
    int64_t size = 0;
    for (const auto& shard : manifest.shards()) size += shard.size_bytes();
    checkpoint->set_size_bytes(size);
    checkpoint->set_num_shards(manifest.shards_size());
    *checkpoint->mutable_create_time() = manifest.create_time();
    if (last && spec_.checkpoint().export_safetensors()) {
      std::string file = absl::StrCat(path, "/model.safetensors");
      RETURN_IF_ERROR(ExportSafetensors(file));
      checkpoint->set_safetensors_path(file);
    }
    checkpoint->set_write_seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    Send(report);
    Log(absl::StrCat("checkpoint ", path));
    return absl::OkStatus();
  }

  absl::Status ExportSafetensors(const std::string& file) {
    std::vector<at::Tensor> keep;
    std::vector<TensorView> views;
    for (const auto& item : model_->named_parameters()) {
      at::Tensor cpu = item.value().detach().to(torch::kCPU, torch::kFloat32).contiguous();
      keep.push_back(cpu);
      views.push_back({.name = item.key(),
                       .dtype = "F32",
                       .shape = cpu.sizes().vec(),
                       .data = cpu.data_ptr(),
                       .nbytes = static_cast<size_t>(cpu.nbytes())});
    }
    return WriteSafetensors(file, views,
                            {{"format", "pt"},
                             {"tessera.job_id", task_.job_id()},
                             {"tessera.step", std::to_string(step_)},
                             {"tessera.preset", summary_.preset()}});
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
  std::vector<at::Tensor> params_;
  std::optional<FusedAdamW> optimizer_;
  std::unique_ptr<c10d::Reducer> reducer_;
  int64_t step_ = 0;
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
