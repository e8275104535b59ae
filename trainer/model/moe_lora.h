// LoRA adapters on a mixture-of-experts layer's routed experts: every expert gets its own pair for
// each targeted projection, stacked like the experts' weights (moe.h) so that expert parallelism
// can shard them with the experts along dim 0: A [E, rank, in] and B [E, out, rank], where E is
// the stacked weight's first dimension (the experts this rank holds), not the model's expert
// count. Expert e computes W_e x + scale * B_e A_e dropout(x) for each adapted projection inside
// the grouped expert compute (MoeLayerImpl's per-expert products), as PEFT computes its adapter
// on each transformers expert module "experts.e.gate_proj". The router and shared experts are not
// adapted. Not thread-safe (module state).
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <set>
#include <string>

namespace tessera::trainer {

// The model-level LoRA targets (LoraOptions::targets) that name an MoE layer's expert projections.
inline constexpr char kMoeLoraGate[] = "mlp.experts.gate";
inline constexpr char kMoeLoraUp[] = "mlp.experts.up";
inline constexpr char kMoeLoraDown[] = "mlp.experts.down";

// One projection's stacked adapters; undefined tensors: not adapted.
struct StackedLoraAdapter {
  torch::Tensor a;  // [E, rank, in]
  torch::Tensor b;  // [E, out, rank]
};

// The expert adapters of one MoE layer.
struct MoeExpertLora {
  StackedLoraAdapter gate, up, down;
  double scale = 0;
  double dropout = 0;
  bool enabled() const { return gate.a.defined() || up.a.defined() || down.a.defined(); }
};

// Registers zero-filled adapters on `experts` (the layer's "experts" module, whose parameters
// "gate", "up", "down" are the stacked weights passed here) for each of `targets` that names an
// expert projection, as child modules "gate", "up", "down" holding "lora_a" and "lora_b", so the
// names read "layers.N.mlp.experts.gate.lora_a" (IsLoraParameter). The caller initialises them.
// `targets` naming another "mlp." module: c10::Error naming it (the router and shared experts
// take no adapters).
MoeExpertLora AttachMoeExpertLora(torch::nn::Module& experts, const torch::Tensor& gate,
                                  const torch::Tensor& up, const torch::Tensor& down, int rank,
                                  double scale, double dropout,
                                  const std::set<std::string>& targets);

// Expert `e`'s SwiGLU down(silu(gate x) * up x) of its tokens x [n, hidden] with its adapters
// added to each adapted projection; dropout on an adapter's input only in `training`.
torch::Tensor ExpertSwiGluWithLora(const torch::Tensor& x, int64_t e, const torch::Tensor& gate,
                                   const torch::Tensor& up, const torch::Tensor& down,
                                   const MoeExpertLora& lora, bool training);

}  // namespace tessera::trainer
