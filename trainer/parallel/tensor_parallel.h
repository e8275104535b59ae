// Megatron-style tensor parallelism (Shoeybi et al. 2019) with sequence parallelism (Korthikanti
// et al. 2022): how a parameter is split over the tp ranks, and the autograd-aware collectives
// that enter and leave a tensor-parallel region.
//
// Splits, as planner/layout_model.cc counts them:
//   column-parallel (rows of the [out, in] weight, and the bias): q, k, v, GPT-2's fused qkv (each
//     of its three blocks split alike, so a rank holds its heads' q, k and v), MLP up/gate/fc;
//   row-parallel (columns of the weight; the bias is replicated and added after the reduction):
//     attention output, MLP down/proj;
//   vocab-parallel: token embedding and LM head rows, ceil(vocab / tp) per rank, the last rank's
//     tail padded with zero rows that no token selects and the loss masks;
//   replicated: norms, position embeddings, row-parallel biases, an MoE layer's router and its
//     shared expert's sigmoid gate;
//   expert column/row-parallel (Megatron's expert tensor parallelism at size tp): the stacked
//     routed-expert tensors [experts, out, in] of trainer/model/moe.h split like the dense SwiGLU,
//     gate and up on their output dim (1), down on its input dim (2); the shared expert's
//     gate/up/down split as the dense MLP's.
// Without sequence parallelism a region is entered by f (identity forward, all-reduce of the
// gradient) and left by g (all-reduce forward, identity backward); with it, activations outside
// the regions are split along the sequence, a region is entered by an all-gather along the
// sequence (reduce-scatter backward) and left by a reduce-scatter (all-gather backward), and the
// replicated parameters' gradients are partial sums the caller all-reduces over tp.
//
// Collectives are issued on the calling thread (forward) or autograd's (backward) and waited
// for; every tp rank runs the same sequence of them.
#pragma once

#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "trainer/torch_pch.h"

namespace tessera::trainer {

struct TensorParallel {
  // Null when size is 1.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0;
  int size = 1;
  bool sequence_parallel = false;
  bool enabled() const { return size > 1; }
};

// How one parameter is split over the tp ranks.
struct ParamShard {
  enum class Kind { kReplicated, kColumn, kRow, kVocab, kExpertColumn, kExpertRow };
  Kind kind = Kind::kReplicated;
  // Column-parallel weights made of several equal blocks of rows split alike (GPT-2's qkv: 3).
  int blocks = 1;
  // The whole tensor's shape.
  std::vector<int64_t> global_shape;
};

// The split a parameter gets, by its name ("layers.3.attn.qkv.weight", "embed.weight", ...) and
// global shape.
ParamShard ShardOfParameter(const std::string& name, const std::vector<int64_t>& global_shape);

// The local shape of `shard` on tp rank `rank` of `size`.
std::vector<int64_t> LocalShape(const ParamShard& shard, int size);

// A contiguous range of a local shard's flattened elements and the block of the global tensor it
// holds (a box whose row-major order is that range's order). Vocab padding rows belong to none.
struct ShardPiece {
  int64_t local_begin = 0;
  int64_t numel = 0;
  std::vector<int64_t> box_offset;
  std::vector<int64_t> box_shape;
};
std::vector<ShardPiece> ShardPieces(const ParamShard& shard, int rank, int size);

// Rank `rank`'s shard of the full tensor `full` (zero-padded vocab rows included).
torch::Tensor LocalShardOf(const torch::Tensor& full, const ParamShard& shard, int rank, int size);

// The vocabulary rows [begin, begin + local) of rank `rank`: local = ceil(vocab / size).
int64_t VocabRowsPerRank(int64_t vocab, int size);

// Region boundaries (identity when tp is off). x is [batch, seq, hidden]; with sequence
// parallelism the sequence dimension outside the region is seq / tp.
torch::Tensor EnterTensorParallel(const torch::Tensor& x, const TensorParallel& tp);
torch::Tensor ExitTensorParallel(const torch::Tensor& x, const TensorParallel& tp);

// Mean cross-entropy over the positions whose target is not -100, of logits split over the
// vocabulary: `logits` [n, local] holds this rank's columns [vocab_begin, vocab_begin + local) of
// which the first `valid` are real (the rest is padding). Never gathers the full logits: the
// max, the sum of exponentials and the target's logit are all-reduced over tp. float32.
torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        int64_t vocab_begin, int64_t valid,
                                        const TensorParallel& tp);

// Identity forward; in backward the gradient is summed over the tp ranks (f, applied to a
// replicated parameter whose gradient each rank computes only a part of: an MoE layer's router
// without sequence parallelism). Identity when tp is off.
torch::Tensor SumGradientOverTensorParallel(const torch::Tensor& x, const TensorParallel& tp);

// Identity forward; the gradient times `scale` in backward.
torch::Tensor ScaleGradient(const torch::Tensor& x, double scale);

// In-place sum over `group` (no-op when null).
void AllReduceSum(const c10::intrusive_ptr<c10d::ProcessGroup>& group, torch::Tensor& tensor);

}  // namespace tessera::trainer
