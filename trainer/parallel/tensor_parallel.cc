#include "trainer/parallel/tensor_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr char kGroupKey[] = "group";

c10d::ProcessGroup* SavedGroup(AutogradContext* ctx) {
  return reinterpret_cast<c10d::ProcessGroup*>(ctx->saved_data[kGroupKey].toInt());
}

int64_t GroupHandle(const TensorParallel& tp) { return reinterpret_cast<int64_t>(tp.group.get()); }

void AllReduceIn(c10d::ProcessGroup* group, at::Tensor& tensor,
                 c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM) {
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp(op);
  std::vector<at::Tensor> tensors{tensor};
  const CollectiveIssue issue =
      IssueCollective(CollectiveKind::kAllReduce, group, TensorBytes(tensors), tensor.is_cuda());
  WaitForPeers(group->allreduce(tensors, options), issue);
}

// [batch, s, d] on each rank -> [batch, size * s, d], rank order along the sequence.
at::Tensor AllGatherSequence(c10d::ProcessGroup* group, const at::Tensor& x) {
  const int size = group->getSize();
  at::Tensor local = x.transpose(0, 1).contiguous();  // [s, batch, d]: ranks' blocks contiguous
  at::Tensor gathered;
  if (local.is_cuda()) {
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] *= size;
    gathered = at::empty(shape, local.options());
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllGather, group, TensorBytes(std::vector{local}), true);
    WaitForPeers(group->_allgather_base(gathered, local), issue);
  } else {
    // Gloo: the list form (its flat all-gather is not implemented for every dtype).
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < size; ++r) outputs[0].push_back(at::empty_like(local));
    std::vector<at::Tensor> inputs{local};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllGather, group, TensorBytes(inputs), false);
    WaitForPeers(group->allgather(outputs, inputs), issue);
    gathered = at::cat(outputs[0], 0);
  }
  return gathered.transpose(0, 1).contiguous();
}

// [batch, s, d] partial sums on each rank -> this rank's [batch, s / size, d] of the sum.
at::Tensor ReduceScatterSequence(c10d::ProcessGroup* group, const at::Tensor& x) {
  const int size = group->getSize();
  TORCH_CHECK(x.size(1) % size == 0, "sequence length ", x.size(1),
              " is not divisible by tensor_parallel ", size);
  at::Tensor full = x.transpose(0, 1).contiguous();  // [s, batch, d]
  const int64_t part = full.size(0) / size;
  at::Tensor mine;
  if (full.is_cuda()) {
    std::vector<int64_t> shape = full.sizes().vec();
    shape[0] = part;
    mine = at::empty(shape, full.options());
    const CollectiveIssue issue = IssueCollective(CollectiveKind::kReduceScatter, group,
                                                  TensorBytes(std::vector{full}), true);
    WaitForPeers(group->_reduce_scatter_base(mine, full), issue);
  } else {
    // Gloo: an all-reduce keeping this rank's block.
    AllReduceIn(group, full);
    mine = full.narrow(0, group->getRank() * part, part);
  }
  return mine.transpose(0, 1).contiguous();
}

// f: identity forward, all-reduce backward.
struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data[kGroupKey] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad = grads[0].contiguous().clone();
    AllReduceIn(SavedGroup(ctx), grad);
    return {grad, at::Tensor()};
  }
};

// g: all-reduce forward, identity backward.
struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, int64_t group) {
    at::Tensor out = x.contiguous().clone();
    AllReduceIn(reinterpret_cast<c10d::ProcessGroup*>(group), out);
    return out;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

struct GatherFromSequence : torch::autograd::Function<GatherFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data[kGroupKey] = group;
    return AllGatherSequence(reinterpret_cast<c10d::ProcessGroup*>(group), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ReduceScatterSequence(SavedGroup(ctx), grads[0]), at::Tensor()};
  }
};

struct ScatterToSequence : torch::autograd::Function<ScatterToSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data[kGroupKey] = group;
    return ReduceScatterSequence(reinterpret_cast<c10d::ProcessGroup*>(group), x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {AllGatherSequence(SavedGroup(ctx), grads[0]), at::Tensor()};
  }
};

struct ScaleGradientFunction : torch::autograd::Function<ScaleGradientFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, double scale) {
    ctx->saved_data["scale"] = scale;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0] * ctx->saved_data["scale"].toDouble(), at::Tensor()};
  }
};

struct VocabParallelCE : torch::autograd::Function<VocabParallelCE> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets, int64_t vocab_begin, int64_t valid,
                            int64_t group_handle) {
    auto* group = reinterpret_cast<c10d::ProcessGroup*>(group_handle);
    at::Tensor real = logits.narrow(1, 0, valid);
    at::Tensor max = std::get<0>(real.max(1));
    AllReduceIn(group, max, c10d::ReduceOp::MAX);
    at::Tensor shifted = real - max.unsqueeze(1);
    at::Tensor exp = shifted.exp();
    at::Tensor sum = exp.sum(1);
    AllReduceIn(group, sum);
    at::Tensor local = targets - vocab_begin;
    at::Tensor in_range = (local >= 0).logical_and(local < valid);
    at::Tensor index = local.clamp(0, valid - 1).unsqueeze(1);
    at::Tensor picked = shifted.gather(1, index).squeeze(1) * in_range.to(shifted.scalar_type());
    AllReduceIn(group, picked);
    at::Tensor keep = (targets != -100).to(shifted.scalar_type());
    // 1 when no target counts: loss 0 and zero gradients rather than 0 / 0.
    at::Tensor count = keep.sum().clamp_min(1);
    at::Tensor loss = ((sum.log() - picked) * keep).sum() / count;
    ctx->save_for_backward({exp.div_(sum.unsqueeze(1)), index, in_range, keep, count});
    ctx->saved_data["local"] = logits.size(1);
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], index = saved[1], in_range = saved[2], keep = saved[3],
               count = saved[4];
    at::Tensor grad = softmax.clone();
    grad.scatter_add_(1, index, -in_range.to(grad.scalar_type()).unsqueeze(1));
    grad.mul_((keep / count * grads[0]).unsqueeze(1));
    const int64_t local = ctx->saved_data["local"].toInt();
    if (grad.size(1) < local) {
      at::Tensor padded = at::zeros({grad.size(0), local}, grad.options());
      padded.narrow(1, 0, grad.size(1)).copy_(grad);
      grad = padded;
    }
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The dim of a stacked expert tensor [experts, out, in] that tp splits: out for gate and up
// (column), in for down (row).
size_t ExpertSplitDim(ParamShard::Kind kind) {
  return kind == ParamShard::Kind::kExpertColumn ? 1 : 2;
}

int64_t Product(const std::vector<int64_t>& shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

ParamShard ShardOfParameter(const std::string& name, const std::vector<int64_t>& global_shape) {
  ParamShard shard;
  shard.global_shape = global_shape;
  using Kind = ParamShard::Kind;
  if (name == "embed.weight" || name == "lm_head") {
    shard.kind = Kind::kVocab;
  } else if (absl::EndsWith(name, ".attn.qkv.weight") || absl::EndsWith(name, ".attn.qkv.bias")) {
    shard.kind = Kind::kColumn;
    shard.blocks = 3;
  } else if (absl::EndsWith(name, ".attn.q.weight") || absl::EndsWith(name, ".attn.k.weight") ||
             absl::EndsWith(name, ".attn.v.weight") || absl::EndsWith(name, ".mlp.fc.weight") ||
             absl::EndsWith(name, ".mlp.fc.bias") || absl::EndsWith(name, ".mlp.gate.weight") ||
             absl::EndsWith(name, ".mlp.up.weight") || absl::EndsWith(name, ".mlp.shared.gate") ||
             absl::EndsWith(name, ".mlp.shared.up")) {
    shard.kind = Kind::kColumn;
  } else if (absl::EndsWith(name, ".attn.proj.weight") || absl::EndsWith(name, ".attn.o.weight") ||
             absl::EndsWith(name, ".mlp.proj.weight") || absl::EndsWith(name, ".mlp.down.weight") ||
             absl::EndsWith(name, ".mlp.shared.down")) {
    shard.kind = Kind::kRow;
  } else if (absl::EndsWith(name, ".mlp.experts.gate") || absl::EndsWith(name, ".mlp.experts.up")) {
    shard.kind = Kind::kExpertColumn;
  } else if (absl::EndsWith(name, ".mlp.experts.down")) {
    shard.kind = Kind::kExpertRow;
  }
  return shard;
}

int64_t VocabRowsPerRank(int64_t vocab, int size) { return (vocab + size - 1) / size; }

std::vector<int64_t> LocalShape(const ParamShard& shard, int size) {
  std::vector<int64_t> shape = shard.global_shape;
  switch (shard.kind) {
    case ParamShard::Kind::kReplicated:
      break;
    case ParamShard::Kind::kColumn:
      TORCH_CHECK(shape[0] % (shard.blocks * size) == 0, "dimension ", shape[0],
                  " does not split into ", shard.blocks, " x ", size, " equal parts");
      shape[0] /= size;
      break;
    case ParamShard::Kind::kRow:
      TORCH_CHECK(shape.size() == 2 && shape[1] % size == 0, "dimension ", shape.back(),
                  " does not split into ", size, " equal parts");
      shape[1] /= size;
      break;
    case ParamShard::Kind::kVocab:
      shape[0] = VocabRowsPerRank(shape[0], size);
      break;
    case ParamShard::Kind::kExpertColumn:
    case ParamShard::Kind::kExpertRow: {
      const size_t dim = ExpertSplitDim(shard.kind);
      TORCH_CHECK(shape.size() == 3 && shape[dim] % size == 0, "expert dimension ",
                  shape.size() == 3 ? shape[dim] : -1, " does not split into ", size,
                  " equal parts");
      shape[dim] /= size;
      break;
    }
  }
  return shape;
}

std::vector<ShardPiece> ShardPieces(const ParamShard& shard, int rank, int size) {
  const std::vector<int64_t>& shape = shard.global_shape;
  if (size == 1 || shard.kind == ParamShard::Kind::kReplicated) {
    return {
        ShardPiece{.local_begin = 0, .numel = Product(shape), .box_offset = {}, .box_shape = {}}};
  }
  std::vector<int64_t> zeros(shape.size(), 0);
  std::vector<ShardPiece> pieces;
  switch (shard.kind) {
    case ParamShard::Kind::kReplicated:
      break;
    case ParamShard::Kind::kColumn: {
      const int64_t block = shape[0] / shard.blocks, local = block / size, row = Product(shape, 1);
      for (int j = 0; j < shard.blocks; ++j) {
        ShardPiece piece{.local_begin = j * local * row,
                         .numel = local * row,
                         .box_offset = zeros,
                         .box_shape = shape};
        piece.box_offset[0] = j * block + rank * local;
        piece.box_shape[0] = local;
        pieces.push_back(std::move(piece));
      }
      break;
    }
    case ParamShard::Kind::kRow: {
      const int64_t local = shape[1] / size;
      pieces.push_back({.local_begin = 0,
                        .numel = shape[0] * local,
                        .box_offset = {0, rank * local},
                        .box_shape = {shape[0], local}});
      break;
    }
    case ParamShard::Kind::kVocab: {
      const int64_t local = VocabRowsPerRank(shape[0], size);
      const int64_t rows = std::clamp<int64_t>(shape[0] - rank * local, 0, local);
      if (rows == 0) break;
      ShardPiece piece{.local_begin = 0,
                       .numel = rows * Product(shape, 1),
                       .box_offset = zeros,
                       .box_shape = shape};
      piece.box_offset[0] = rank * local;
      piece.box_shape[0] = rows;
      pieces.push_back(std::move(piece));
      break;
    }
    case ParamShard::Kind::kExpertColumn:
    case ParamShard::Kind::kExpertRow: {
      // One box: every expert's slice of the split dim, in the local tensor's own order.
      const size_t dim = ExpertSplitDim(shard.kind);
      const int64_t local = shape[dim] / size;
      ShardPiece piece{.local_begin = 0,
                       .numel = Product(shape) / size,
                       .box_offset = zeros,
                       .box_shape = shape};
      piece.box_offset[dim] = rank * local;
      piece.box_shape[dim] = local;
      pieces.push_back(std::move(piece));
      break;
    }
  }
  return pieces;
}

torch::Tensor LocalShardOf(const torch::Tensor& full, const ParamShard& shard, int rank, int size) {
  if (size == 1) return full;
  const std::vector<int64_t> local_shape = LocalShape(shard, size);
  switch (shard.kind) {
    case ParamShard::Kind::kReplicated:
      return full;
    case ParamShard::Kind::kColumn: {
      std::vector<int64_t> blocked = full.sizes().vec();
      blocked[0] /= shard.blocks;
      blocked.insert(blocked.begin(), shard.blocks);
      const int64_t local = blocked[1] / size;
      return full.reshape(blocked).narrow(1, rank * local, local).reshape(local_shape);
    }
    case ParamShard::Kind::kRow:
      return full.narrow(1, rank * local_shape[1], local_shape[1]);
    case ParamShard::Kind::kVocab: {
      at::Tensor out = at::zeros(local_shape, full.options());
      const int64_t rows =
          std::clamp<int64_t>(full.size(0) - rank * local_shape[0], 0, local_shape[0]);
      if (rows > 0) out.narrow(0, 0, rows).copy_(full.narrow(0, rank * local_shape[0], rows));
      return out;
    }
    case ParamShard::Kind::kExpertColumn:
    case ParamShard::Kind::kExpertRow: {
      const auto dim = static_cast<int64_t>(ExpertSplitDim(shard.kind));
      return full.narrow(dim, rank * local_shape[dim], local_shape[dim]);
    }
  }
  return full;
}

torch::Tensor EnterTensorParallel(const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.enabled()) return x;
  return tp.sequence_parallel ? GatherFromSequence::apply(x, GroupHandle(tp))
                              : CopyToRegion::apply(x, GroupHandle(tp));
}

torch::Tensor ExitTensorParallel(const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.enabled()) return x;
  return tp.sequence_parallel ? ScatterToSequence::apply(x, GroupHandle(tp))
                              : ReduceFromRegion::apply(x, GroupHandle(tp));
}

torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        int64_t vocab_begin, int64_t valid,
                                        const TensorParallel& tp) {
  TORCH_CHECK(valid >= 1, "tensor-parallel rank ", tp.rank, " holds no vocabulary rows");
  return VocabParallelCE::apply(logits.to(torch::kFloat32), targets, vocab_begin, valid,
                                GroupHandle(tp));
}

torch::Tensor SumGradientOverTensorParallel(const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.enabled()) return x;
  return CopyToRegion::apply(x, GroupHandle(tp));
}

torch::Tensor ScaleGradient(const torch::Tensor& x, double scale) {
  if (scale == 1.0) return x;
  return ScaleGradientFunction::apply(x, scale);
}

void AllReduceSum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, torch::Tensor& tensor) {
  if (group) AllReduceIn(group.get(), tensor);
}

}  // namespace tessera::trainer
