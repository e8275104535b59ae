#include "trainer/model/lora.h"

#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "trainer/model/moe_lora.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

using Kind = ParamShard::Kind;

// All-gathers `local` over tp's group and puts each rank's part where `shard` (whose global shape
// is the whole tensor's over tp alone) says it lies.
torch::Tensor GatherOverTensorParallel(const torch::Tensor& local, const ParamShard& shard,
                                       const TensorParallel& tp) {
  std::vector<torch::Tensor> input{local.contiguous()};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < tp.size; ++r) output[0].push_back(torch::empty_like(input[0]));
  // Outside any step (the final export): timed for the totals, waited for at once.
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kAllGather, tp.group.get(),
                                                TensorBytes(input) * tp.size, local.is_cuda());
  tp.group->allgather(output, input)->wait();
  RecordCollective(issue);
  torch::Tensor whole = torch::zeros(shard.global_shape, local.options());
  for (int r = 0; r < tp.size; ++r) {
    const torch::Tensor flat = output[0][r].reshape(-1);
    for (const ShardPiece& piece : ShardPieces(shard, r, tp.size)) {
      torch::Tensor box = whole;
      for (size_t d = 0; d < piece.box_shape.size(); ++d) {
        box = box.narrow(static_cast<int64_t>(d), piece.box_offset[d], piece.box_shape[d]);
      }
      box.copy_(flat.narrow(0, piece.local_begin, piece.numel).view(piece.box_shape));
    }
  }
  return whole;
}

}  // namespace

bool IsLoraParameter(const std::string& name) {
  return absl::EndsWith(name, ".lora_a") || absl::EndsWith(name, ".lora_b");
}

LoraAdapter AttachLoraAdapter(torch::nn::Module& linear, const torch::Tensor& weight,
                              const LoraOptions& options, LinearSplit split,
                              const TensorParallel& tp) {
  // The local weight's shape gives the local adapters': a column-parallel layer's out and a
  // row-parallel layer's in are this rank's part, as B's rows and A's columns are.
  const int64_t out = weight.size(0), in = weight.size(1);
  LoraAdapter adapter;
  adapter.a = linear.register_parameter("lora_a", torch::zeros({options.rank, in}));
  adapter.b = linear.register_parameter("lora_b", torch::zeros({out, options.rank}));
  adapter.scale = options.scale;
  adapter.dropout = options.dropout;
  adapter.split = split;
  adapter.tp = tp;
  return adapter;
}

torch::Tensor PartialGradientOverTensorParallel(const torch::Tensor& matrix,
                                                const TensorParallel& tp) {
  if (!tp.enabled() || tp.sequence_parallel) return matrix;
  return SumGradientOverTensorParallel(matrix, tp);
}

torch::Tensor AddLoraDelta(torch::Tensor y, const LoraAdapter& lora, const torch::Tensor& x,
                           bool training) {
  if (!lora.a.defined()) return y;
  // Under tp every rank draws its own dropout mask: a row-parallel rank's for its own columns; a
  // column-parallel layer's ranks see the same x, so their masks differ where one process has one.
  const torch::Tensor in =
      lora.dropout > 0 ? F::dropout(x, F::DropoutFuncOptions().p(lora.dropout).training(training))
                       : x;
  if (lora.split == LinearSplit::kRow && lora.tp.enabled()) {
    // Each rank's x A is a partial sum over its input columns: summed (or reduce-scattered along
    // the sequence, as y was) before the replicated B.
    const torch::Tensor h = ExitTensorParallel(F::linear(in, lora.a), lora.tp);
    return y + F::linear(h, lora.b) * lora.scale;
  }
  const torch::Tensor a = PartialGradientOverTensorParallel(lora.a, lora.tp);
  return y + F::linear(F::linear(in, a), lora.b) * lora.scale;
}

std::string LoraBaseParameterName(const std::string& adapter) {
  for (const char* matrix : {".lora_a", ".lora_b"}) {
    if (!absl::EndsWith(adapter, matrix)) continue;
    const std::string layer = adapter.substr(0, adapter.size() - std::string(matrix).size());
    return IsExpertParameter(layer) ? layer : absl::StrCat(layer, ".weight");
  }
  return adapter;
}

ParamShard LoraShardOf(const std::string& name, const std::vector<int64_t>& local_shape,
                       const ParamShard& base, int tp_size, int ep_size) {
  const bool is_a = absl::EndsWith(name, ".lora_a");
  ParamShard shard;
  shard.global_shape = local_shape;
  // The dim this rank holds a part of: B's rows for a column-parallel base, A's columns for a
  // row-parallel one; -1 for a replicated adapter matrix.
  int64_t split_dim = -1;
  switch (base.kind) {
    case Kind::kColumn:
      if (!is_a) {
        shard.kind = Kind::kColumn;
        // GPT-2's qkv: B's rows split in three blocks, as the weight's.
        shard.blocks = base.blocks;
        split_dim = 0;
      }
      break;
    case Kind::kRow:
      if (is_a) {
        shard.kind = Kind::kRow;
        split_dim = 1;
      }
      break;
    case Kind::kExpertColumn:
      if (!is_a) {
        shard.kind = Kind::kExpertColumn;
        split_dim = 1;
      }
      break;
    case Kind::kExpertRow:
      if (is_a) {
        shard.kind = Kind::kExpertRow;
        split_dim = 2;
      }
      break;
    case Kind::kReplicated:
    case Kind::kVocab:
      break;
  }
  if (split_dim >= 0) shard.global_shape[split_dim] *= tp_size;
  if (IsExpertLoraParameter(name)) shard.global_shape[0] *= ep_size;
  return shard;
}

torch::Tensor GatherWholeTensor(const std::string& name, const torch::Tensor& local,
                                const ParamShard& shard, const TensorParallel& tp,
                                const ExpertParallel& ep) {
  torch::NoGradGuard no_grad;
  torch::Tensor value = local.detach();
  const bool expert = IsExpertShardedParameter(name);
  if (tp.enabled() && shard.kind != Kind::kReplicated) {
    // The whole over tp of this rank's experts.
    ParamShard over_tp = shard;
    if (expert) over_tp.global_shape[0] = value.size(0);
    value = GatherOverTensorParallel(value, over_tp, tp);
  }
  if (expert) value = GatherExpertShards(value, ep);
  return value.to(torch::kCPU, torch::kFloat32);
}

}  // namespace tessera::trainer
