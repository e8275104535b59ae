#include "trainer/runtime/train_loop.h"

#include <ATen/record_function.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "planner/lr_schedule.h"
#include "trainer/model/hf_weights.h"
#include "trainer/parallel/context_parallelism.h"
#include "trainer/parallel/peer_wait.h"
#include "trainer/report/expert_load.h"
#include "trainer/report/step_breakdown.h"
#include "trainer/runtime/final_export.h"
#include "trainer/runtime/step_profiler.h"
#if TESSERA_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace tessera::trainer {
namespace {

// Rank 0 logs the step's breakdown after the first step, the last, and every this many.
constexpr int64_t kBreakdownLogInterval = 10;

int64_t PeakHostMemoryBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

// Keeps the cp rank's two chunks of every row of `mb` (context_parallelism.h) and recounts its
// targets, so that LossWeight(mb) is this rank's share of the step's counted targets.
void KeepContextParallelPart(MicroBatch& mb, const ContextParallel& cp) {
  if (!cp.enabled() || mb.batch_size == 0) return;
  mb.inputs = ShardRowsForContextParallel(mb.inputs, mb.seq_len, cp);
  mb.targets = ShardRowsForContextParallel(mb.targets, mb.seq_len, cp);
  if (!mb.positions.empty()) {
    mb.positions = ShardRowsForContextParallel(mb.positions, mb.seq_len, cp);
  }
  mb.seq_len /= cp.size;
  mb.loss_tokens = std::count_if(mb.targets.begin(), mb.targets.end(),
                                 [](int64_t target) { return target != kIgnoreTarget; });
}

}  // namespace

TrainLoop::TrainLoop(const v1::TrainerTask& task, const TrainOptions& options,
                     const RunReporter& reporter, TrainingRun& run)
    : task_(task),
      spec_(task.spec()),
      options_(options),
      reporter_(reporter),
      run_(run),
      step_(run.start_step),
      tokens_seen_(run.tokens_seen),
      timer_(options.step_breakdown),
      peak_flops_(PeakFlopsForDevice(run.device.name)),
      // With LoRA the frozen base computes no weight gradients: 2N fewer per token, N the
      // parameters active per token (the planner's LoRA model). A plan stored before MoE has no
      // active count: every parameter is active there.
      flops_per_token_(run.summary.flops_per_token() -
                       (run.lora.has_value()
                            ? 2.0 * static_cast<double>(run.summary.num_active_parameters() > 0
                                                            ? run.summary.num_active_parameters()
                                                            : run.summary.num_parameters())
                            : 0.0)) {
  result_.start_step = run.start_step;
  result_.resumed_from = run.resumed_from;
  if (spec_.has_guard()) guard_.emplace(spec_.guard());
}

at::Tensor TrainLoop::ToDevice(std::vector<int64_t>& values, int batch, int seq) {
  return torch::from_blob(values.data(), {batch, seq}, torch::kInt64).to(run_.device.device, true);
}

at::Tensor TrainLoop::PositionsOf(MicroBatch& mb, int seq) {
  return mb.positions.empty() ? at::Tensor() : ToDevice(mb.positions, mb.batch_size, seq);
}

void TrainLoop::AddStageRouterLoss(at::Tensor& step_loss, double weight) {
  // A mixture-of-experts stage before the last adds its layers' weighted router loss to the
  // step's loss, as the last stage's output holds its own; the step's all-reduce sums them.
  const double coef = run_.model->dims().router_aux_loss_coef();
  const at::Tensor aux = run_.model->last_router_aux_loss();
  if (coef == 0 || !aux.defined()) return;
  step_loss += aux.to(step_loss.device(), torch::kFloat32) * (coef * weight);
}

at::Tensor TrainLoop::ForwardBackward(std::vector<MicroBatch>& micro_batches) {
  const int accumulation = static_cast<int>(micro_batches.size());
  ShardedEngine& engine = *run_.engine;
  // The step's loss is the sum of every counted target's loss over the global batch (all
  // micro-batches, all dp ranks) divided by their number. A micro-batch's mean loss therefore
  // weighs LossWeight() = its counted targets / the step's, both in its loss and in its
  // gradient, so that the dp group's summed gradient is that of the global batch however the
  // loss mask spreads the counted targets (1 / (accumulation * dp) without a mask).
  at::Tensor step_loss = torch::zeros({}, torch::TensorOptions().device(run_.device.device));
  if (run_.pipeline.has_value()) {
    PipelineSchedule& pipeline = *run_.pipeline;
    pipeline.Train(
        accumulation,
        [&](int chunk, int i, const at::Tensor& input) {
          StepTimer::Scope forward(timer_, StepPhase::kForward);
          MicroBatch& mb = micro_batches[i];
          at::Tensor output = engine.ForwardStage(
              pipeline.first(chunk) ? ToDevice(mb.inputs, mb.batch_size, mb.seq_len) : input,
              pipeline.last(chunk) ? ToDevice(mb.targets, mb.batch_size, mb.seq_len)
                                   : at::Tensor(),
              PositionsOf(mb, mb.seq_len), chunk);
          if (pipeline.last(chunk)) {
            step_loss += output.detach().to(torch::kFloat32) * LossWeight(mb);
          } else {
            AddStageRouterLoss(step_loss, LossWeight(mb));
          }
          return output;
        },
        [&](int, int i, const at::Tensor& output, const at::Tensor& grad, bool last) {
          StepTimer::Scope backward(timer_, StepPhase::kBackward);
          engine.BackwardStage(output, grad, LossWeight(micro_batches[i]), last);
        });
    return step_loss;
  }
  for (int i = 0; i < accumulation; ++i) {
    MicroBatch& mb = micro_batches[i];
    at::Tensor inputs = ToDevice(mb.inputs, mb.batch_size, mb.seq_len);
    at::Tensor targets = ToDevice(mb.targets, mb.batch_size, mb.seq_len);
    const double weight = LossWeight(mb);
    at::Tensor loss;
    {
      // The engine runs both passes: it times its forward, the rest is the backward's.
      StepTimer::Scope backward(timer_, StepPhase::kBackward);
      loss = engine.ForwardBackward(inputs, targets, weight,
                                    /*last=*/i == accumulation - 1, PositionsOf(mb, mb.seq_len));
    }
    if (timer_.enabled()) {
      timer_.Add(StepPhase::kForward, engine.last_forward_seconds());
      timer_.Add(StepPhase::kBackward, -engine.last_forward_seconds());
    }
    step_loss += loss.to(torch::kFloat32) * weight;
  }
  return step_loss;
}

absl::StatusOr<double> TrainLoop::TrainStep(double learning_rate, double* grad_norm) {
  std::vector<MicroBatch> micro_batches;
  {
    StepTimer::Scope data_wait(timer_, StepPhase::kDataWait);
    micro_batches = NextMicroBatches();
  }
  const ContextParallel cp = ContextParallelOf(run_.mesh);
  for (MicroBatch& mb : micro_batches) KeepContextParallelPart(mb, cp);
  at::Tensor step_loss = ForwardBackward(micro_batches);
  if (run_.pipeline.has_value() && run_.model->dims().num_experts() > 0) {
    // Each stage reported its own layers' share of the router loss; the report shows the model's.
    run_.model->SumRouterAuxLossOver(*run_.mesh.group(MeshDim::kPipeline));
  }
  if (run_.group.has_value()) {
    // The last pipeline stage's ranks hold the weighted losses, every tp rank the same value;
    // the weights already divide by the dp group's counted targets.
    std::vector<at::Tensor> tensors{step_loss};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, run_.group->group.get(), TensorBytes(tensors),
                        step_loss.is_cuda());
    WaitForPeers(run_.group->group->allreduce(tensors), issue);
    step_loss = tensors[0] / run_.mesh.size(MeshDim::kTensor);
  }
  double loss_value = step_loss.item<double>();
  if (options_.nan_loss_from_step > 0 && step_ + 1 >= options_.nan_loss_from_step) {
    loss_value = std::numeric_limits<double>::quiet_NaN();
  }
  if (options_.loss_spike_at_batch > 0 &&
      BatchIndexOfStep(spec_.guard(), step_ + 1) + 1 == options_.loss_spike_at_batch) {
    loss_value *= 1000;
  }
  // A guarded job judges a non-finite loss with the gradient norm, below: a spike to roll back.
  if (!guard_.has_value() && !std::isfinite(loss_value)) {
    // The step is reported (its loss gauge reads NaN, for dashboards and alerts), never applied.
    if (reporter_.rank() == 0) {
      v1::TrainerReport report = reporter_.NewReport();
      v1::StepMetrics* m = report.mutable_metrics();
      m->set_step(step_ + 1);
      m->set_loss(loss_value);
      m->set_learning_rate(learning_rate);
      *m->mutable_time() = report.time();
      reporter_.Send(report);
    }
    return absl::InternalError(absl::StrCat("loss is ", loss_value, " at step ", step_ + 1));
  }
  // A save started after the last step may still be copying the state the optimizer changes.
  step_checkpoint_blocked_seconds_ = run_.checkpointer->AwaitSnapshot();
  checkpoint_blocked_seconds_ += step_checkpoint_blocked_seconds_;
  // A global batch without a counted target (every target masked) has nothing to learn from:
  // AdamW would still move the weights by its momentum and decay. Every rank counts the same
  // step total from the masks, so all of them skip together.
  const bool update = micro_batches.empty() || micro_batches.front().step_loss_tokens > 0;
  if (!update) {
    reporter_.Log(absl::StrCat("step ", step_ + 1,
                               ": no counted target in the global batch (every target masked); "
                               "the optimizer step is skipped"));
  }
  StepTimer::Scope optimizer(timer_, StepPhase::kOptimizer);
  if (!guard_.has_value()) {
    *grad_norm = run_.engine->Step(learning_rate, run_.settings.clip_norm, update);
    return loss_value;
  }
  *grad_norm = run_.engine->Step(learning_rate, run_.settings.clip_norm, update,
                                 [&](double norm) { return GuardAccepts(loss_value, norm); });
  return loss_value;
}

std::vector<MicroBatch> TrainLoop::NextMicroBatches() {
  if (guard_.has_value()) {
    // Skipped batches are drawn and dropped, so that the loader's position (and every checkpoint
    // taken after) is past them, as if the run had trained on them.
    const int64_t skipped = BatchesSkippedAt(spec_.guard(), step_ + 1);
    for (int64_t i = 0; i < skipped; ++i) run_.loader->NextStep();
    if (skipped > 0) {
      reporter_.Log(absl::StrCat("step ", step_ + 1, ": ", skipped,
                                 " global batch(es) skipped (guard.skipped)"));
    }
  }
  return run_.loader->NextStep();
}

bool TrainLoop::GuardAccepts(double loss, double grad_norm) {
  std::optional<v1::LossSpike> spike = guard_->Check(step_ + 1, loss, grad_norm);
  bool spiked = spike.has_value();
  if (run_.group.has_value()) {
    // On the CPU (Gloo, also beside NCCL), as StopAgreed: one flag.
    std::vector<at::Tensor> flag{torch::full({1}, spiked ? 1 : 0, torch::kInt32)};
    run_.group->group->allreduce(flag)->wait();
    spiked = flag[0].item<int32_t>() > 0;
  }
  if (!spiked) {
    guard_->Accept(loss, grad_norm);
    return true;
  }
  if (!spike.has_value()) {
    // Every rank sees the same all-reduced loss and norm; this covers a disagreement anyway.
    spike.emplace();
    spike->set_step(step_ + 1);
    spike->set_loss(loss);
    spike->set_grad_norm(grad_norm);
    spike->set_cause(absl::StrCat("another rank judged step ", step_ + 1, " a spike"));
  }
  spike->set_batch_index(BatchIndexOfStep(spec_.guard(), step_ + 1));
  spike_ = std::move(spike);
  return false;
}

int64_t TrainLoop::PeakMemoryBytes() {
#if TESSERA_WITH_CUDA
  const torch::Device& device = run_.device.device;
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    int64_t peak = stats.allocated_bytes[0].peak;
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return peak;
  }
#endif
  return PeakHostMemoryBytes();
}

MicroBatch TrainLoop::ValidationBatch(int index) const {
  const TokenDataset& validation = *run_.validation;
  const int micro = spec_.batch().micro_batch_size();
  const int seq = spec_.data().seq_len();
  MicroBatch mb;
  mb.seq_len = seq;
  for (int i = 0; i < micro; ++i) {
    int64_t sample = (static_cast<int64_t>(index) * run_.mesh.size(MeshDim::kData) +
                      run_.mesh.coord(MeshDim::kData)) *
                         micro +
                     i;
    if (sample >= validation.num_samples()) break;
    mb.inputs.resize(mb.inputs.size() + seq);
    mb.targets.resize(mb.targets.size() + seq);
    if (validation.has_record_starts()) mb.positions.resize(mb.inputs.size());
    mb.loss_tokens += validation.ReadExample(
        sample, mb.inputs.data() + mb.inputs.size() - seq,
        mb.targets.data() + mb.targets.size() - seq,
        mb.positions.empty() ? nullptr : mb.positions.data() + mb.positions.size() - seq);
    ++mb.batch_size;
  }
  KeepContextParallelPart(mb, ContextParallelOf(run_.mesh));
  return mb;
}

void TrainLoop::Evaluate() {
  torch::NoGradGuard no_grad;
  run_.model->eval();
  const int micro = spec_.batch().micro_batch_size();
  at::Tensor totals = torch::zeros({2}, torch::TensorOptions().dtype(torch::kFloat64));
  for (int b = 0; b < run_.settings.eval_batches; ++b) {
    MicroBatch mb = ValidationBatch(b);
    if (mb.batch_size == 0) break;
    const int seq = mb.seq_len;  // a cp rank's part of the sequence
    at::Tensor loss;
    if (run_.pipeline.has_value()) {
      PipelineSchedule& pipeline = *run_.pipeline;
      // Evaluation batches may be smaller than a micro-batch: fixed-shape sends need full ones.
      if (mb.batch_size != micro) break;
      loss = pipeline.Evaluate([&](int chunk, int, const at::Tensor& input) {
        return run_.engine->ForwardStage(
            pipeline.first(chunk) ? ToDevice(mb.inputs, mb.batch_size, seq) : input,
            pipeline.last(chunk) ? ToDevice(mb.targets, mb.batch_size, seq) : at::Tensor(),
            PositionsOf(mb, seq), chunk);
      });
      if (!loss.defined()) continue;  // only the last stage counts
    } else {
      loss = run_.engine->EvalLoss(ToDevice(mb.inputs, mb.batch_size, seq),
                                   ToDevice(mb.targets, mb.batch_size, seq), PositionsOf(mb, seq));
    }
    // Each tp rank holds the same loss: one of them counts it.
    if (run_.mesh.coord(MeshDim::kTensor) != 0) continue;
    // The batch's loss is the mean over its counted targets.
    totals[0] += loss.item<double>() * static_cast<double>(mb.loss_tokens);
    totals[1] += static_cast<double>(mb.loss_tokens);
  }
  run_.model->train();
  if (run_.group.has_value()) {
    std::vector<at::Tensor> tensors{totals};
    run_.group->group->allreduce(tensors)->wait();
  }
  if (reporter_.rank() != 0 || totals[1].item<double>() == 0) return;
  double loss = totals[0].item<double>() / totals[1].item<double>();
  v1::TrainerReport report = reporter_.NewReport();
  v1::EvalMetrics* eval = report.mutable_eval();
  eval->set_step(step_);
  eval->set_loss(loss);
  eval->set_perplexity(std::exp(loss));
  eval->set_tokens(static_cast<int64_t>(totals[1].item<double>()));
  reporter_.Send(report);
}

void TrainLoop::ReportStep(double loss, double grad_norm, double learning_rate, double seconds,
                           const v1::StepTimeBreakdown& breakdown) {
  const int64_t tokens_per_step = spec_.batch().global_batch_size() * spec_.data().seq_len();
  const int64_t peak_memory = PeakMemoryBytes();
  {
    v1::TrainerReport report = reporter_.NewReport();
    v1::RankStepMetrics* r = report.mutable_rank_step();
    r->set_step(step_);
    r->set_step_time_seconds(seconds);
    r->set_peak_memory_bytes(peak_memory);
    if (timer_.enabled()) *r->mutable_breakdown() = breakdown;
    *r->mutable_time() = report.time();
    reporter_.Send(report);
  }
  if (reporter_.rank() == 0) {
    v1::TrainerReport report = reporter_.NewReport();
    v1::StepMetrics* m = report.mutable_metrics();
    m->set_step(step_);
    m->set_loss(loss);
    m->set_grad_norm(grad_norm);
    m->set_learning_rate(learning_rate);
    m->set_step_time_seconds(seconds);
    m->set_tokens_per_second(tokens_per_step / seconds);
    m->set_samples_per_second(spec_.batch().global_batch_size() / seconds);
    m->set_mfu(peak_flops_ > 0 ? flops_per_token_ * (tokens_per_step / seconds) /
                                     (task_.assignment().world_size() * peak_flops_)
                               : 0.0);
    m->set_peak_memory_bytes(peak_memory);
    m->set_tokens_seen(tokens_seen_);
    m->set_max_steps(run_.max_steps);
    m->set_checkpoint_blocked_seconds(checkpoint_blocked_seconds_);
    if (const at::Tensor aux = run_.model->last_router_aux_loss(); aux.defined()) {
      m->set_router_aux_loss(aux.item<double>());
    }
    // The same micro-batch's routing, per layer (every layer of a mixture of experts routes).
    if (const at::Tensor counts = run_.model->last_tokens_per_expert();
        counts.defined() && counts.dim() == 2) {
      const at::Tensor host = counts.to(torch::kCPU, torch::kInt64).contiguous();
      const int64_t* values = host.data_ptr<int64_t>();
      for (v1::ExpertLoad& load :
           ExpertLoads(std::vector<int64_t>(values, values + host.numel()),
                       static_cast<int>(host.size(0)), static_cast<int>(host.size(1)))) {
        *m->add_expert_load() = std::move(load);
      }
    }
    m->set_epoch(static_cast<double>(step_) * spec_.batch().global_batch_size() /
                 static_cast<double>(run_.samples_per_epoch));
    if (timer_.enabled()) *m->mutable_breakdown() = breakdown;
    *m->mutable_time() = report.time();
    reporter_.Send(report);
    run_.step_metrics.Add(*m);
    if (timer_.enabled() && (step_ % kBreakdownLogInterval == 0 ||
                             step_ == result_.start_step + 1 || step_ == run_.max_steps)) {
      reporter_.Log(absl::StrFormat("step %d: loss %.4f, %.3f s: %s", step_, loss, seconds,
                                    BreakdownSummary(breakdown, seconds)));
    }
  }
  // Reported with this step, then counted afresh.
  checkpoint_blocked_seconds_ = 0;
}

absl::Status TrainLoop::FinishStep(bool* stop, v1::FailureKind* kind) {
  const bool last = step_ == run_.max_steps;
  const int64_t eval_interval = spec_.data().eval_interval_steps();
  if (run_.validation.has_value() && (last || step_ % eval_interval == 0)) Evaluate();
  const int64_t interval = spec_.checkpoint().interval_steps();
  const bool periodic = interval > 0 && step_ % interval == 0;
  const bool checkpoints = !task_.checkpoint_directory().empty();
  *kind = v1::FAILURE_KIND_CHECKPOINT_ERROR;
  if (checkpoints && (last || periodic)) RETURN_IF_ERROR(SaveCheckpoint(last));
  if (last || !StopAgreed()) return absl::OkStatus();
  // This step's checkpoint, committed before the exit: the job resumes from it elsewhere.
  if (checkpoints) {
    RETURN_IF_ERROR(periodic ? run_.checkpointer->Wait()
                             : SaveCheckpoint(/*last=*/false, /*wait=*/true));
  }
  *stop = true;
  return absl::OkStatus();
}

absl::Status TrainLoop::Run(v1::FailureKind* kind) {
  const int64_t tokens_per_step = spec_.batch().global_batch_size() * spec_.data().seq_len();
  StepProfiler profiler(options_.profile, reporter_.rank(), run_.device.device.is_cuda());
  while (step_ < run_.max_steps) {
    profiler.BeforeStep(step_ + 1);
    auto start = std::chrono::steady_clock::now();
    timer_.StartStep();
    step_checkpoint_blocked_seconds_ = 0;
    const double waited_before = PeerWaitSeconds();
    double lr = planner::LearningRateAt(spec_.optimizer().schedule(), run_.max_steps, step_ + 1);
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
    if (spike_.has_value()) {
      // A good step's checkpoint still being written is the one the job rolls back to: every
      // rank finishes it (the spike's own step never starts one), and its commit is reported
      // before the spike, which the coordinator decides the rollback on.
      if (absl::Status saved = run_.checkpointer->Wait(); !saved.ok()) {
        reporter_.Log(
            absl::StrCat("the checkpoint in flight at the spike failed: ", saved.message()));
      }
      if (reporter_.rank() == 0) {
        v1::TrainerReport report = reporter_.NewReport();
        *report.mutable_loss_spike() = *spike_;
        reporter_.Send(report);
      }
      *kind = v1::FAILURE_KIND_LOSS_SPIKE;
      return absl::AbortedError(absl::StrCat(
          "loss spike: ", spike_->cause(), "; its update was not applied (global batch ",
          spike_->batch_index() + 1, "): the job rolls back to its last checkpoint"));
    }
    if (const std::string graphs = run_.engine->CudaGraphStatus(); graphs != graph_status_logged_) {
      reporter_.Log(absl::StrCat("CUDA graphs: ", graphs));
      graph_status_logged_ = graphs;
    }
    ++step_;
    tokens_seen_ += tokens_per_step;
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const v1::StepTimeBreakdown breakdown =
        timer_.FinishStep(seconds, step_checkpoint_blocked_seconds_);
    if (options_.progress != nullptr) {
      const double busy = std::max(0.0, seconds - (PeerWaitSeconds() - waited_before));
      options_.progress->StepFinished(step_, seconds, busy,
                                      timer_.enabled() ? &breakdown : nullptr);
    }
    result_.final_loss = *loss;
    ReportStep(*loss, grad_norm, lr, seconds, breakdown);
    // Before evaluation and checkpoints, so that the trace holds training steps only.
    const bool last = step_ == run_.max_steps;
    if (absl::StatusOr<std::string> trace = profiler.AfterStep(step_, last); !trace.ok()) {
      reporter_.Log(absl::StrCat("profile not written: ", trace.status().message()));
    } else if (!trace->empty()) {
      reporter_.Log(absl::StrCat("profile of steps ", options_.profile.first_step, " to ", step_,
                                 " written to ", *trace));
    }
    bool stop = false;
    RETURN_IF_ERROR(FinishStep(&stop, kind));
    if (stop) {
      result_.stopped = true;
      break;
    }
  }
  result_.final_step = step_;
  return absl::OkStatus();
}

bool TrainLoop::StopAgreed() {
  if (options_.stop_requested == nullptr) return false;
  const bool asked = options_.stop_requested->load(std::memory_order_relaxed);
  if (!run_.group.has_value()) return asked;
  // On the CPU (Gloo, also beside NCCL): no device synchronisation for one flag.
  std::vector<at::Tensor> flag{torch::full({1}, asked ? 1 : 0, torch::kInt32)};
  run_.group->group->allreduce(flag)->wait();
  return flag[0].item<int32_t>() > 0;
}

absl::Status TrainLoop::SaveCheckpoint(bool last, bool wait) {
  CheckpointState state{.step = step_,
                        .tokens_seen = tokens_seen_,
                        .layout = task_.plan().layout(),
                        .model = run_.summary,
                        .data_position = run_.loader->position(),
                        .step_metrics = nullptr};
  state.layout.set_data_parallel(run_.mesh.size(MeshDim::kData));
  state.layout.set_tensor_parallel(run_.mesh.size(MeshDim::kTensor));
  state.layout.set_pipeline_parallel(run_.mesh.size(MeshDim::kPipeline));
  // Snapshot now: the save is written while later steps are added.
  if (reporter_.rank() == 0) {
    state.step_metrics = std::make_shared<const std::string>(run_.step_metrics.EncodedUpTo(step_));
  }
  auto committed = std::make_shared<v1::Checkpoint>();
  const auto start = std::chrono::steady_clock::now();
  AsyncCheckpointer& checkpointer = *run_.checkpointer;
  RETURN_IF_ERROR(checkpointer.Start(
      state, last && FinalExportNeedsTesseraFile(spec_),
      // The reporter, not the loop: the run's checkpointer (and so this callback) may outlive it.
      [reporter = &reporter_, wait = last || wait, committed](const v1::Checkpoint& checkpoint) {
        // Rank 0's background thread; a waited-for checkpoint is reported after the wait below.
        if (wait) {
          *committed = checkpoint;
          return;
        }
        v1::TrainerReport report = reporter->NewReport();
        *report.mutable_checkpoint() = checkpoint;
        reporter->Send(report);
      }));
  if (!last && !wait) {
    checkpoint_blocked_seconds_ += checkpointer.last_blocked_seconds();
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(checkpointer.Wait());
  checkpoint_blocked_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // LoRA runs without pipeline splits, but under tensor or expert parallelism each rank holds only
  // its part of the adapters (and of the base the merged export needs): every rank joins the
  // gathers, then rank 0 writes them.
  LoraAdapterValues adapters;
  CausalLM merged{nullptr};
  if (last && run_.lora.has_value()) {
    ASSIGN_OR_RETURN(adapters, GatherLoraAdapters(*run_.model));
    ASSIGN_OR_RETURN(merged, GatherMergedExportModel(spec_, *run_.model, adapters,
                                                     /*keep=*/reporter_.rank() == 0));
  }
  if (reporter_.rank() != 0) return absl::OkStatus();
  if (last && run_.lora.has_value()) {
    const std::string dir = absl::StrCat(committed->path(), "/adapter");
    RETURN_IF_ERROR(ExportPeftAdapter(*run_.model, *run_.lora, dir,
                                      spec_.model().from_pretrained(), &adapters));
    reporter_.Log(absl::StrCat("LoRA adapter in PEFT's layout: ", dir));
  }
  if (last) {
    ASSIGN_OR_RETURN(const std::vector<std::string> exported,
                     WriteFinalHfExport({.task = &task_,
                                         .summary = &run_.summary,
                                         .checkpoint_path = committed->path(),
                                         .model = run_.model.get(),
                                         .lora = run_.lora.has_value() ? &*run_.lora : nullptr,
                                         .lora_adapters = &adapters,
                                         .merged_model = merged ? merged.get() : nullptr}));
    for (const std::string& dir : exported) {
      reporter_.Log(absl::StrCat("Hugging Face export: ", dir));
    }
  }
  v1::TrainerReport report = reporter_.NewReport();
  *report.mutable_checkpoint() = *committed;
  reporter_.Send(report);
  return absl::OkStatus();
}

}  // namespace tessera::trainer
