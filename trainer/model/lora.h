// LoRA adapters (Hu et al. 2021) on the dense linear layers of a transformer block, and how every
// adapter (the dense layers' and the MoE experts' of moe_lora.h) is split under tensor
// parallelism, the way Megatron-Core / NeMo shard their parallel adapters:
//   column-parallel base (q, k, v, GPT-2's qkv, MLP up/gate/fc; routed experts' gate/up):
//     A [rank, in] replicated, B [out, rank] split by output rows like the base. x A is computed
//     whole on every tp rank but each rank's B sees only its rows of the output gradient, so A's
//     gradient is a partial sum over tp, summed like the MoE router's (in backward without
//     sequence parallelism; by the engine with it, as for every replicated parameter).
//   row-parallel base (attention output, MLP down/proj; routed experts' down):
//     A [rank, in] split by input columns like the base, each rank's x A a partial sum. For a
//     dense layer it is summed over tp (reduce-scattered along the sequence under sequence
//     parallelism) before the replicated B, so B's gradient is whole (or a sequence part the
//     engine sums). Inside an MoE layer the partial product goes through B and joins the layer's
//     own partial output, summed once by the layer (no collective per expert), and B's gradient
//     is summed over tp like A's above.
// Every adapter's global shape and split is a ParamShard (LoraShardOf), so checkpoints save boxes
// of the whole adapters and any layout resumes them. Not thread-safe (module state).
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "trainer/parallel/expert_parallel.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tessera::trainer {

// LoRA (job.proto's LoraSpec), resolved: adapters of rank `rank` on the linear layers named in
// `targets` by their Tessera suffix after "layers.N." ("attn.q", "attn.qkv", "mlp.down", ...).
struct LoraOptions {
  int rank = 0;
  // Adapters add scale * B A dropout(x): scale = alpha / rank.
  double scale = 1;
  double dropout = 0;
  std::set<std::string> targets;
};

// How a linear layer is split over tp (tensor_parallel.h).
enum class LinearSplit { kColumn, kRow };

// One linear layer's adapter: parameters "lora_a" [rank, in] and "lora_b" [out, rank] registered
// on the linear module, so their names are "layers.N.attn.q.lora_a" and so on, each this rank's
// part of the whole adapter (see above). Undefined tensors: the layer has none.
struct LoraAdapter {
  torch::Tensor a;
  torch::Tensor b;
  double scale = 0;
  double dropout = 0;
  LinearSplit split = LinearSplit::kColumn;
  TensorParallel tp;
};

// True for the parameter names of LoRA adapters (".lora_a", ".lora_b").
bool IsLoraParameter(const std::string& name);

// Registers zero-filled "lora_a" and "lora_b" on `linear`, whose local weight (this rank's shard,
// [out, in]) is `weight`, split over `tp` as `split` says. The caller initialises them.
LoraAdapter AttachLoraAdapter(torch::nn::Module& linear, const torch::Tensor& weight,
                              const LoraOptions& options, LinearSplit split,
                              const TensorParallel& tp);

// y + scale * B A dropout(x), for y the linear layer's output for x (both as the layer sees them:
// a row-parallel layer's x is this rank's columns, its y the reduced output), with the tp
// collectives above. y unchanged when the adapter is undefined.
torch::Tensor AddLoraDelta(torch::Tensor y, const LoraAdapter& lora, const torch::Tensor& x,
                           bool training);

// A replicated adapter matrix whose gradient each tp rank computes only part of, as the forward
// reads it: its gradient summed over tp in backward, except under sequence parallelism, where the
// engine sums the replicated parameters' gradients. The tensor itself without tp.
torch::Tensor PartialGradientOverTensorParallel(const torch::Tensor& matrix,
                                                const TensorParallel& tp);

// The name of the base parameter an adapter adapts: "layers.0.attn.q.lora_a" ->
// "layers.0.attn.q.weight"; a routed expert adapter "layers.0.mlp.experts.gate.lora_b" ->
// "layers.0.mlp.experts.gate".
std::string LoraBaseParameterName(const std::string& adapter);

// The split of adapter `name` (this rank's tensor of shape `local_shape`) whose base is split as
// `base` (ShardOfParameter's kind), with its whole shape: over `tp_size` as above, and for a routed
// expert adapter its logical [num_experts, ...] over `ep_size` along dim 0.
ParamShard LoraShardOf(const std::string& name, const std::vector<int64_t>& local_shape,
                       const ParamShard& base, int tp_size, int ep_size);

// The whole tensor of which `local` is this rank's part as `shard` says (a collective over tp's
// group, and for a routed expert adapter or weight (IsExpertShardedParameter of `name`) ep's too:
// every rank of those groups calls it in the same order with like-shaped parts). Float32 on the
// CPU. For exports, outside a step.
torch::Tensor GatherWholeTensor(const std::string& name, const torch::Tensor& local,
                                const ParamShard& shard, const TensorParallel& tp,
                                const ExpertParallel& ep);

}  // namespace tessera::trainer
