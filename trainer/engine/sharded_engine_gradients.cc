// ShardedEngine's gradients on their way to the step: the first backward of a step writing the
// flat buffers (ZeRO 0/1), a unit's gradients reduced (all-reduce or reduce-scatter over dp) once
// all of them arrived, at most max_in_flight reductions outstanding, and the sums over tp
// (sequence parallelism's replicated parameters) and over pp (tied embeddings) before them.
#include <algorithm>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "trainer/engine/sharded_engine.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {

at::Tensor ShardedEngine::GradientView(const Unit& unit, const Entry& entry) {
  return unit.full_grad.narrow(0, entry.offset, entry.numel).view(entry.shape);
}

void ShardedEngine::BeginFirstBackward() {
  if (graph_ != nullptr) {
    // cuda_graphs: every backward accumulates into the flat gradients, as the graph does.
    if (gradients_empty_) PrepareGradientsForAccumulation();
    return;
  }
  if (stage() > 1 || !gradients_empty_) return;
  // Autograd accumulates into a defined .grad (grad += new) and takes the new gradient over
  // when .grad is undefined: without .grad, the first backward's gradients are copied into
  // the flat buffer once instead of being added to zeros written by the last step.
  for (Unit& unit : units_) {
    for (Entry& entry : unit.entries) {
      entry.param.mutable_grad().reset();
      entry.arrived = false;
    }
  }
  writing_first_gradients_ = true;
}

void ShardedEngine::EndFirstBackward() {
  if (!writing_first_gradients_) return;
  torch::NoGradGuard no_grad;
  for (Unit& unit : units_) {
    for (Entry& entry : unit.entries) {
      if (entry.arrived) continue;
      // No gradient this backward (or an exception cut it short): zeros, as before the step.
      at::Tensor view = GradientView(unit, entry);
      view.zero_();
      entry.param.mutable_grad() = view;
    }
  }
  writing_first_gradients_ = false;
  gradients_empty_ = false;
}

void ShardedEngine::OnGradientReady(int u, int e) {
  if (writing_first_gradients_) {
    Unit& unit = units_[u];
    Entry& entry = unit.entries[e];
    at::Tensor view = GradientView(unit, entry);
    {
      torch::NoGradGuard no_grad;
      view.copy_(entry.param.grad());
    }
    entry.param.mutable_grad() = view;
    entry.arrived = true;
  }
  if (stage() <= 1 && !last_micro_batch_) return;  // accumulate locally until the last one
  if (u == 0 && defer_outer_unit()) return;        // Step reduces it after the tied sum
  Unit& unit = units_[u];
  if (++unit.ready < static_cast<int>(unit.entries.size())) return;
  unit.ready = 0;
  SumReplicatedGradients(u);
  ReduceUnit(u);
  if (stage() == 3) Free(u);
}

void ShardedEngine::ReduceUnit(int u) {
  Unit& unit = units_[u];
  torch::NoGradGuard no_grad;
  at::Tensor input;
  if (stage() <= 1) {
    input = unit.full_grad;
  } else {
    std::vector<at::Tensor> pieces;
    pieces.reserve(unit.entries.size() + 1);
    for (Entry& entry : unit.entries) pieces.push_back(entry.param.grad().reshape({-1}));
    input = TakeBuffer(unit.padded, unit.shard_grad.options());
    at::Tensor values = input.narrow(0, 0, unit.numel);
    at::cat_out(values, pieces);
    if (unit.padded > unit.numel) input.narrow(0, unit.numel, unit.padded - unit.numel).zero_();
    for (Entry& entry : unit.entries) entry.param.mutable_grad().reset();
  }
  if (unit.size == 1) {
    if (stage() >= 2) {
      unit.shard_grad.add_(input);
      GiveBuffer(std::move(input));
    }
    return;
  }
  while (static_cast<int>(pending_.size()) >= std::max(1, options_.max_in_flight)) FinishOldest();
  Pending pending;
  pending.unit = u;
  pending.input = input;
  if (stage() == 0 || options_.sharded_collectives_as_all_reduce) {
    std::vector<at::Tensor> tensors{input};
    pending.issue = IssueCollective(CollectiveKind::kAllReduce, unit.group.get(),
                                    TensorBytes(tensors), input.is_cuda());
    pending.work = unit.group->allreduce(tensors);
  } else {
    pending.output = TakeBuffer(unit.shard, input.options());
    pending.issue = IssueCollective(CollectiveKind::kReduceScatter, unit.group.get(),
                                    TensorBytes(std::vector{input}), input.is_cuda());
    pending.work = unit.group->_reduce_scatter_base(pending.output, pending.input);
  }
  WaitNowWhenProbing(pending.work, &pending.issue);
  pending_.push_back(std::move(pending));
}

void ShardedEngine::FinishOldest() {
  Pending pending = std::move(pending_.front());
  pending_.pop_front();
  WaitForPeers(pending.work, pending.issue);
  torch::NoGradGuard no_grad;
  Unit& unit = units_[pending.unit];
  if (options_.sharded_collectives_as_all_reduce && stage() >= 2) {
    // The whole unit was all-reduced; this rank keeps its shard of it.
    unit.shard_grad.add_(pending.input.narrow(0, OwnedBegin(unit), unit.shard));
    GiveBuffer(std::move(pending.input));
    return;
  }
  if (!pending.output.defined()) return;
  if (stage() == 1) {
    unit.shard_grad.copy_(pending.output);
  } else {
    unit.shard_grad.add_(pending.output);
    GiveBuffer(std::move(pending.input));
  }
  GiveBuffer(std::move(pending.output));
}

void ShardedEngine::FinishAll() {
  while (!pending_.empty()) FinishOldest();
}

void ShardedEngine::SumReplicatedGradients(int u) {
  if (!options_.tp.enabled() || !options_.tp.sequence_parallel) return;
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (Entry& entry : units_[u].entries) {
    if (entry.replicated && entry.param.grad().defined()) grads.push_back(entry.param.grad());
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> flat;
  for (const at::Tensor& grad : grads) flat.push_back(grad.reshape({-1}));
  at::Tensor sum = at::cat(flat);
  AllReduceSum(options_.tp.group, sum);
  int64_t offset = 0;
  for (at::Tensor& grad : grads) {
    grad.copy_(sum.narrow(0, offset, grad.numel()).view_as(grad));
    offset += grad.numel();
  }
}

void ShardedEngine::SumTiedEmbeddingGradients() {
  torch::NoGradGuard no_grad;
  at::Tensor grad;
  for (Entry& entry : units_[0].entries) {
    if (entry.name == "embed.weight") grad = entry.param.grad();
  }
  if (!grad.defined()) {
    // A middle stage: zeros of the embedding's shape.
    const v1::ModelDims& dims = model_->dims();
    grad = at::zeros({VocabRowsPerRank(dims.vocab_size(), options_.tp.size), dims.hidden_size()},
                     at::TensorOptions()
                         .dtype(at::kFloat)
                         .device(units_.back().full.defined() ? units_.back().full.device()
                                                              : at::Device(at::kCPU)));
    AllReduceSum(options_.pp_group, grad);
    return;
  }
  AllReduceSum(options_.pp_group, grad);
}

}  // namespace tessera::trainer
