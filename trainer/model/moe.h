// A mixture-of-experts feed-forward layer with Qwen3-MoE / Mixtral semantics (Hugging Face
// transformers' Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, and Qwen2MoeSparseMoeBlock for the
// optional shared expert): a linear router scores every token against every expert, a softmax
// over experts and a top-k pick each token's experts and their weights, each expert is a SwiGLU
// MLP, and the token's output is the weighted sum of its experts' outputs. Computation is dropless
// and grouped by expert: no capacity factor, every (token, expert) slot is computed, one matrix
// product per expert over the tokens routed to it. Forward also returns HF's load-balancing
// auxiliary loss and the per-expert token counts. The experts' weights are stacked 3-D tensors
// [num_experts, ...] so that expert parallelism can shard them along dim 0; HfMoeParameterNames
// says which Hugging Face tensors stack into each. Not thread-safe (a torch::nn::Module).
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/model/moe_lora.h"
#include "trainer/parallel/expert_parallel.h"

namespace tessera::trainer {

// One MoE layer's shape and behaviour (HF config field names in brackets).
struct MoeOptions {
  int64_t hidden_size = 0;
  // Routed experts [num_experts, num_local_experts] and how many each token uses
  // [num_experts_per_tok].
  int64_t num_experts = 0;
  int64_t top_k = 0;
  // Each routed expert's SwiGLU width [moe_intermediate_size, Mixtral: intermediate_size].
  int64_t expert_intermediate_size = 0;
  // Renormalise each token's top-k weights to sum to 1 [norm_topk_prob]. Mixtral always does
  // (set true); Qwen3-MoE checkpoints say in their config; Qwen2-MoE's default is false.
  bool norm_topk_prob = true;
  // Shared experts, applied to every token and added to the routed output, fused into one SwiGLU
  // of width num_shared_experts * shared_intermediate_size (as DeepSeek fuses its shared experts;
  // Qwen2-MoE has one, [shared_expert_intermediate_size]). 0: none (Qwen3-MoE, Mixtral).
  int64_t num_shared_experts = 0;
  int64_t shared_intermediate_size = 0;
  // Scale the shared experts' output by sigmoid(x . w) with a learned w [1, hidden] per token, as
  // transformers' Qwen2MoeSparseMoeBlock does (shared_expert_gate); false: added ungated, as
  // DeepseekV3MoE does.
  bool shared_expert_gate = true;
  // The weight of the load-balancing loss in the training loss [router_aux_loss_coef].
  double aux_loss_coef = 0;
  // Standard deviation of the normal initialisation of every parameter [initializer_range].
  double init_std = 0.02;
};

// OK, or INVALID_ARGUMENT naming the field at fault (sizes positive, top_k in [1, num_experts],
// shared sizes both set or both zero, init_std and aux_loss_coef non-negative).
absl::Status ValidateMoeOptions(const MoeOptions& options);

// The router's decision for T tokens.
struct MoeRouting {
  // softmax(tokens router^T) over experts, [T, num_experts], in float32 (float64 for float64
  // tokens: HF softmaxes in float32 always; a float64 run keeps float64 so tests compare tightly).
  torch::Tensor probs;
  // Each token's experts by descending probability, int64 [T, top_k].
  torch::Tensor indices;
  // Their combine weights (the top-k probabilities, renormalised under norm_topk_prob), in the
  // tokens' dtype, [T, top_k].
  torch::Tensor weights;
};

// What MoeLayerImpl::forward returns.
struct MoeOutput {
  // The layer's output, x's shape and dtype.
  torch::Tensor output;
  // HF's load_balancing_loss_func for this layer alone: num_experts * sum_e f_e * P_e, where f_e
  // is the fraction of tokens that chose expert e among their top_k (sum_e f_e = top_k) and P_e
  // the mean router probability of e; top_k when perfectly balanced. A scalar in probs' dtype,
  // differentiable through P (f is a count). Reported as a metric. With expert parallelism, f
  // and P are over the union of the ep ranks' tokens (ranks hold equally many), and P's gradient
  // reaches each rank's own router probabilities only (MeanOverExperts).
  torch::Tensor aux_loss;
  // aux_loss_coef * aux_loss: the term the training loss adds.
  torch::Tensor weighted_aux_loss;
  // Token slots of x routed to each expert, int64 [num_experts], on x's device (sums to T *
  // top_k); this rank's tokens only, with or without expert parallelism (as router_prob_mean).
  torch::Tensor tokens_per_expert;
  // P above, [num_experts], differentiable (with tp, its gradient reaches the router times
  // 1 / tp: every tp rank adds the same loss of it). HF's model-level loss concatenates every
  // layer's router logits before taking f and P (not a mean of per-layer losses); a model that
  // wants it exactly combines tokens_per_expert and router_prob_mean over layers.
  torch::Tensor router_prob_mean;
  // The router's choice for x's tokens flattened to [T, top_k] (MoeRouting::indices).
  torch::Tensor expert_indices;
};

// The MoE layer. Parameters (names relative to the layer; HF's nn.Linear [out, in] layout, so a
// stacked tensor is torch.stack of HF's per-expert weights along a new dim 0):
//   router.weight        [num_experts, hidden]
//   experts.gate         [num_experts, expert_intermediate, hidden]
//   experts.up           [num_experts, expert_intermediate, hidden]
//   experts.down         [num_experts, hidden, expert_intermediate]
//   shared.gate          [shared, hidden]    (shared = num_shared_experts *
//   shared.up            [shared, hidden]     shared_intermediate_size; only with shared experts)
//   shared.down          [hidden, shared]
//   shared.sigmoid_gate  [1, hidden]         (only with shared_expert_gate)
// Expert e computes down_e (silu(gate_e x) * up_e x).
//
// With expert parallelism (ep.size > 1) the layer holds only experts [FirstExpert, FirstExpert +
// num_experts / ep) of its ep rank: experts.{gate,up,down} are [num_experts / ep, ...], rows
// FirstExpert.. of the logical [num_experts, ...] tensors (the model names their place for
// checkpoints). The router and the shared experts stay whole on every rank. Each rank routes its
// own tokens, sends every slot to its expert's rank (ExchangeRows), the experts run grouped there
// and the outputs come back by the reverse exchange; the gradients of a rank's experts then hold
// the contributions of every ep rank's tokens (summed, not averaged: a caller that averages
// losses over ranks scales them alike).
//
// With tensor parallelism (tp.size > 1; Megatron-Core's expert tensor parallelism at size tp)
// every expert is split like the dense SwiGLU MLP: experts.{gate,up} hold this tp rank's
// expert_intermediate / tp rows of each expert ([local experts, f / tp, hidden]), experts.down
// the matching columns ([local experts, hidden, f / tp]), and the shared expert likewise. The
// layer is a tensor-parallel region (tensor_parallel.h): x enters it (all-gathered along the
// sequence under sequence parallelism, so that the router sees every token of the sequence), the
// router runs on the whole tokens, replicated over tp, every tp rank dispatches the same slots to
// the ep ranks of its own tp coordinate, and each rank's partial sum over its slice of f, weighted
// by the combine weights, leaves the region by the all-reduce (reduce-scatter under sequence
// parallelism) the dense row-parallel down uses. So every gradient behind the exit is this rank's
// part of the whole one, and the entry sums x's over tp: the router weight's (and the shared
// expert's sigmoid gate's) gradient is summed over tp here without sequence parallelism (the
// engine sums the replicated parameters' under it), and the router loss's gradient enters each
// rank's probabilities times 1 / tp (router_prob_mean), since every tp rank adds the same loss.
class MoeLayerImpl : public torch::nn::Module {
 public:
  // CHECKs ValidateMoeOptions, that ep.size divides num_experts and that tp.size divides the
  // expert and shared widths. Parameters are created with `tensor_options` and, unless on the
  // meta device, drawn from N(0, init_std^2); a sharded expert tensor is drawn whole and sliced,
  // so that every layout starts from the same weights.
  explicit MoeLayerImpl(const MoeOptions& options,
                        const torch::TensorOptions& tensor_options = torch::kFloat32,
                        ExpertParallel ep = {}, TensorParallel tp = {});

  // x [..., hidden] ([batch, seq / tp, hidden] under sequence parallelism). Computes on x's
  // device; on a GPU it waits once for the per-expert counts (the split sizes of the grouped
  // products).
  MoeOutput forward(const torch::Tensor& x);

  // The router alone, for tokens [T, hidden].
  MoeRouting Route(const torch::Tensor& tokens) const;

  const MoeOptions& options() const { return options_; }
  const ExpertParallel& expert_parallel() const { return ep_; }
  const TensorParallel& tensor_parallel() const { return tp_; }

  // The routed experts over `rows` [n, hidden] grouped by this rank's local expert, sizes[l] rows
  // for local expert l, with the stacked weights gate, up [local, f, hidden], down [local,
  // hidden, f]: [n, hidden], rows in the same order. Every expert computation goes through here,
  // with the experts' LoRA adapters when AddLora gave them (sized like the local experts).
  torch::Tensor GroupedExperts(const torch::Tensor& rows, const std::vector<int64_t>& sizes,
                               const torch::Tensor& gate, const torch::Tensor& up,
                               const torch::Tensor& down) const;

  // Per-expert LoRA adapters on the expert projections `targets` names (moe_lora.h).
  void AddLora(int rank, double scale, double dropout, const std::set<std::string>& targets);

  // QLoRA: holds the stacked expert weight `projection` ("gate", "up" or "down") in NF4 from
  // `value` (this rank's experts, the parameter's shape), expert by expert (QuantizeStackedNf4);
  // the float parameter leaves the module. Call before AddLora.
  void QuantizeExpertsNf4(const std::string& projection, const torch::Tensor& value);

 private:
  // sum over each token's slots of weight * expert(token), [T, hidden]; counts [num_experts].
  torch::Tensor RoutedExperts(const torch::Tensor& tokens, const MoeRouting& routing,
                              const torch::Tensor& counts) const;
  // The expert outputs of `slot_rows` [n, hidden], grouped by global expert with `sizes`
  // [num_experts] rows each, computed on the experts' ranks; the same rows' order.
  torch::Tensor DispatchToExperts(const torch::Tensor& slot_rows,
                                  const std::vector<int64_t>& sizes) const;
  torch::Tensor SharedExperts(const torch::Tensor& tokens) const;
  // A replicated parameter (the router, the shared expert's sigmoid gate) as the forward uses it:
  // with tp, its gradient summed over tp (each rank computes its part) unless sequence
  // parallelism has the engine sum it.
  torch::Tensor ReplicatedWeight(const torch::Tensor& weight) const;

  MoeOptions options_;
  ExpertParallel ep_;
  TensorParallel tp_;
  torch::Tensor router_weight_;
  torch::Tensor expert_gate_, expert_up_, expert_down_;
  torch::Tensor shared_gate_, shared_up_, shared_down_, shared_sigmoid_gate_;  // undefined: none
  MoeExpertLora expert_lora_;
};
TORCH_MODULE(MoeLayer);

// The gradient scale of a pipeline stage's router loss (Megatron-Core's MoEAuxLossAutoScaler):
// the loss weight of the micro-batch whose backward runs next. A middle stage's backward starts
// from the gradient its successor sends, which carries the cross-entropy's weight but not the
// stage's own router term, so the engine says the weight here before each stage backward.
// Shared by the model and the AttachAuxLoss nodes of its forward calls; single-threaded, as the
// module.
struct AuxLossScale {
  double value = 1.0;
};

// x itself in forward (a new tensor with x's values); in backward x's gradient passes through and
// `aux` (a scalar, already multiplied by router_aux_loss_coef) receives scale->value as its
// gradient, as if the stage's output were the loss plus `aux`. A pipeline stage that is not the
// last joins its layers' router loss to the backward through its output this way.
// `scale` must outlive the autograd graph (the model owns it).
torch::Tensor AttachAuxLoss(const torch::Tensor& x, const torch::Tensor& aux,
                            const AuxLossScale* scale);

// The Hugging Face families whose MoE blocks this layer reads and writes.
enum class HfMoeFamily {
  // Qwen3MoeForCausalLM, and Qwen2MoeForCausalLM for the shared expert: the block is
  // "model.layers.N.mlp", experts "experts.E.{gate,up,down}_proj".
  kQwenMoe,
  // MixtralForCausalLM: the block is "model.layers.N.block_sparse_moe", experts
  // "experts.E.{w1,w3,w2}" (gate, up, down). No shared experts.
  kMixtral,
};

// The block's module name under "model.layers.N." ("mlp" or "block_sparse_moe").
std::string HfMoeBlockName(HfMoeFamily family);

// One MoeLayerImpl parameter and the HF tensors it holds, both named relative to their block.
// Stacked: hf_names has num_experts names and the parameter is their torch.stack along a new
// dim 0, expert e at index e (export: unbind dim 0). Else hf_names has one name, the same tensor.
struct HfMoeTensor {
  std::string name;
  std::vector<std::string> hf_names;
  bool stacked = false;
};

// Every parameter MoeLayerImpl(options) has, in its registration order, with its HF names for
// `family`. INVALID_ARGUMENT when the options are invalid or `family` cannot hold them (Mixtral
// with shared experts; Qwen with more than one shared expert or an ungated one).
absl::StatusOr<std::vector<HfMoeTensor>> HfMoeParameterNames(const MoeOptions& options,
                                                             HfMoeFamily family);

}  // namespace tessera::trainer
