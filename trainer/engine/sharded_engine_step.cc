// ShardedEngine's entry points of a step: forward and backward of a micro-batch (eagerly, or
// through the CUDA graph) or of a pipeline stage, the optimizer step (the global gradient norm,
// clipping, AdamW, the all-gather of the updated shards under ZeRO 1/2), and evaluation.
#include <chrono>
#include <cmath>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "trainer/engine/sharded_engine.h"
#include "trainer/engine/sharded_engine_internal.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {

using sharded_engine_internal::AutocastScope;

at::Tensor ShardedEngine::ForwardBackward(const at::Tensor& inputs, const at::Tensor& targets,
                                          double scale, bool last, const at::Tensor& positions) {
  last_micro_batch_ = last;
  last_forward_seconds_ = 0;
  if (graph_ != nullptr) {
    if (std::optional<at::Tensor> loss = GraphForwardBackward(inputs, targets, scale, positions)) {
      return *loss;
    }
  }
  return EagerForwardBackward(inputs, targets, scale, positions);
}

at::Tensor ShardedEngine::EagerForwardBackward(const at::Tensor& inputs, const at::Tensor& targets,
                                               double scale, const at::Tensor& positions) {
  for (Unit& unit : units_) unit.ready = 0;
  if (stage() == 3) EnsureGathered(0);
  at::Tensor loss;
  const auto forward_start = std::chrono::steady_clock::now();
  {
    AutocastScope autocast(options_.bf16);
    loss = model_->Loss(inputs, targets, positions);
  }
  last_forward_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - forward_start).count();
  BeginFirstBackward();
  FirstBackwardScope first(this);
  (loss * scale).backward();
  FinishAll();
  return loss.detach();
}

at::Tensor ShardedEngine::ForwardStage(const at::Tensor& input, const at::Tensor& targets,
                                       const at::Tensor& positions, int chunk) {
  TORCH_CHECK(stage() <= 1, "pipeline stages run ZeRO 0 or 1");
  AutocastScope autocast(options_.bf16);
  return model_->StageForward(input, targets, positions, chunk);
}

void ShardedEngine::BackwardStage(const at::Tensor& output, const at::Tensor& grad, double scale,
                                  bool last) {
  last_micro_batch_ = last;
  for (Unit& unit : units_) unit.ready = 0;
  BeginFirstBackward();
  FirstBackwardScope first(this);
  if (grad.defined()) {
    // A mixture-of-experts stage's own router loss joins this backward with the micro-batch's
    // weight (AttachAuxLoss).
    model_->set_aux_loss_scale(scale);
    output.backward(grad);
  } else {
    (output * scale).backward();
  }
}

double ShardedEngine::Step(double lr, double clip_norm, bool update,
                           const std::function<bool(double norm)>& accept) {
  FinishAll();
  if (defer_outer_unit()) {
    SumTiedEmbeddingGradients();
    if (!units_[0].entries.empty()) {
      SumReplicatedGradients(0);
      ReduceUnit(0);
      FinishAll();
    }
  }
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(runs_.size());
  for (const Run& run : runs_) grads.push_back(run.param.grad());
  at::Device device = at::kCPU;
  for (const Unit& unit : units_) {
    if (unit.full.defined()) device = unit.full.device();
  }
  at::Tensor squares = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  for (const auto& [share, views] : norm_groups_) {
    std::vector<at::Tensor> norms = at::_foreach_norm(views, 2);
    squares += at::stack(norms).to(at::kDouble).pow(2).sum() * share;
  }
  if (options_.world_group) {
    std::vector<at::Tensor> tensors{squares};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, options_.world_group.get(),
                        TensorBytes(tensors), squares.is_cuda());
    WaitForPeers(options_.world_group->allreduce(tensors), issue);
  } else if (options_.dp_size > 1) {
    std::vector<at::Tensor> tensors{squares};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, options_.dp_group.get(), TensorBytes(tensors),
                        squares.is_cuda());
    WaitForPeers(options_.dp_group->allreduce(tensors), issue);
  }
  const double norm = std::sqrt(squares.item<double>());
  if (update && accept && !accept(norm)) update = false;
  if (std::isfinite(clip_norm) && !grads.empty()) {
    const double coef = clip_norm / (norm + 1e-6);
    if (coef < 1) at::_foreach_mul_(grads, coef);
  }
  if (!update) {
    ZeroGradients();
    return norm;
  }
  optimizer_->Step(lr);
  if (stage() == 1 || stage() == 2) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<CollectiveIssue> issues;
    std::vector<at::Tensor> inputs;
    for (Unit& unit : units_) {
      if (unit.entries.empty() || unit.size == 1) continue;
      issues.emplace_back();
      if (options_.sharded_collectives_as_all_reduce) {
        works.push_back(GatherInto(unit, unit.owned, &issues.back()));
        continue;
      }
      // A copy of the shard: c10d's all-gather does not promise to accept an input that aliases
      // its output on every backend.
      inputs.push_back(TakeBuffer(unit.shard, unit.owned.options()));
      inputs.back().copy_(unit.owned);
      works.push_back(GatherInto(unit, inputs.back(), &issues.back()));
    }
    for (size_t i = 0; i < works.size(); ++i) WaitForPeers(works[i], issues[i]);
    for (at::Tensor& input : inputs) GiveBuffer(std::move(input));
  }
  ZeroGradients();
  return norm;
}

void ShardedEngine::ZeroGradients() {
  if (stage() <= 1) {
    // The next backward writes every parameter's gradient (EndFirstBackward zeroes those it
    // missed); the padding past a unit's parameters is never written and stays zero.
    gradients_empty_ = true;
    return;
  }
  for (Unit& unit : units_) {
    if (!unit.entries.empty()) unit.shard_grad.zero_();
  }
}

at::Tensor ShardedEngine::EvalLoss(const at::Tensor& inputs, const at::Tensor& targets,
                                   const at::Tensor& positions) {
  torch::NoGradGuard no_grad;
  if (stage() == 3) EnsureGathered(0);
  at::Tensor loss;
  {
    AutocastScope autocast(options_.bf16);
    loss = model_->Loss(inputs, targets, positions);
  }
  if (stage() == 3) Free(0);
  return loss;
}

}  // namespace tessera::trainer
