// LoRA adapters on a mixture-of-experts layer's routed experts: every expert gets its own pair for
// each targeted projection, stacked like the experts' weights (moe.h) so that expert parallelism
// can shard them with the experts along dim 0: A [E, rank, in] and B [E, out, rank], where E is
// the stacked weight's first dimension (the experts this rank holds), not the model's expert
// count. Expert e computes W_e x + scale * B_e A_e dropout(x) for each adapted projection inside
// the grouped expert compute (MoeLayerImpl's per-expert products), as PEFT computes its adapter
// on each transformers expert module "experts.e.gate_proj". The router and shared experts are not
// adapted. With expert parallelism the adapters are sharded exactly like the experts: each ep rank
// holds its experts' rows, the engine reduces their gradients over the edp group and checkpoints
// them as boxes of the logical [num_experts, ...] tensors (IsExpertShardedParameter), and the
// PEFT export all-gathers them (GatherExpertShards). Not thread-safe (module state).
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "trainer/model/nf4.h"
#include "trainer/parallel/expert_parallel.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tessera::trainer {

// The model-level LoRA targets (LoraOptions::targets) that name an MoE layer's expert projections.
inline constexpr char kMoeLoraGate[] = "mlp.experts.gate";
inline constexpr char kMoeLoraUp[] = "mlp.experts.up";
inline constexpr char kMoeLoraDown[] = "mlp.experts.down";

// Whether a model parameter is a routed expert projection's stacked adapter
// ("layers.N.mlp.experts.gate.lora_a", ... "experts.down.lora_b").
bool IsExpertLoraParameter(const std::string& name);

// Whether a parameter is split along dim 0 over the ep group: a routed expert tensor
// (IsExpertParameter) or one of its adapters. The engine reduces such a parameter's gradient over
// edp instead of dp and saves it as a box of its logical tensor.
bool IsExpertShardedParameter(const std::string& name);

// The logical [num_experts, ...] tensor of which `local` holds this ep rank's rows [FirstExpert,
// FirstExpert + LocalExperts): all-gathered over the ep group (a collective: every ep rank of the
// group calls it, with equally shaped shards), on `local`'s device. `local` itself when ep is off.
torch::Tensor GatherExpertShards(const torch::Tensor& local, const ExpertParallel& ep);

// One projection's stacked adapters; undefined tensors: not adapted.
struct StackedLoraAdapter {
  torch::Tensor a;  // [E, rank, in]
  torch::Tensor b;  // [E, out, rank]
};

// One projection's frozen expert weights in NF4 under QLoRA (nf4.h): each expert's [out, in]
// weight quantized on its own with double quantization (64-value blocks, as a dense weight),
// their four state tensors stacked along a new dim 0 [E, ...]. Undefined codes: not in NF4.
struct StackedNf4Weight {
  torch::Tensor codes, absmax_codes, absmax_scales, absmax_offset;
  std::vector<int64_t> shape;  // one expert's [out, in]
  bool defined() const { return codes.defined(); }
  // Expert e's weight: views of row e of the stacked state.
  Nf4Tensor Expert(int64_t e) const;
};

// Quantizes a stacked expert weight `value` [E, out, in] expert by expert and registers the
// state as frozen parameters "weight_nf4_codes", "weight_nf4_absmax_codes",
// "weight_nf4_absmax_scales", "weight_nf4_absmax_offset" of `holder` (the projection's child
// module of the layer's "experts", so the names read "layers.N.mlp.experts.gate.weight_nf4_codes",
// which IsNf4Parameter knows). c10::Error for a value QuantizeNf4 refuses.
StackedNf4Weight QuantizeStackedNf4(torch::nn::Module& holder, const torch::Tensor& value);

// The expert adapters of one MoE layer, and under QLoRA its experts' NF4 base.
struct MoeExpertLora {
  StackedLoraAdapter gate, up, down;
  StackedNf4Weight gate_nf4, up_nf4, down_nf4;
  double scale = 0;
  double dropout = 0;
  bool enabled() const { return gate.a.defined() || up.a.defined() || down.a.defined(); }
  bool nf4() const { return gate_nf4.defined(); }
};

// Registers zero-filled adapters on `experts` (the layer's "experts" module, whose parameters
// "gate", "up", "down" are the stacked weights passed here) for each of `targets` that names an
// expert projection, as child modules "gate", "up", "down" holding "lora_a" and "lora_b", so the
// names read "layers.N.mlp.experts.gate.lora_a" (IsLoraParameter). The caller initialises them.
// A weight held in NF4 is a meta tensor of its shape: its adapters are float32 on the CPU, in the
// child module that holds its NF4 state.
// `targets` naming another "mlp." module: c10::Error naming it (the router and shared experts
// take no adapters).
MoeExpertLora AttachMoeExpertLora(torch::nn::Module& experts, const torch::Tensor& gate,
                                  const torch::Tensor& up, const torch::Tensor& down, int rank,
                                  double scale, double dropout,
                                  const std::set<std::string>& targets);

// `lora` as one forward call reads it under tensor parallelism (lora.h): the replicated adapter
// matrices whose gradients each tp rank computes only part of (gate's and up's A, down's B) with
// their gradients summed over tp (PartialGradientOverTensorParallel), once for every expert of the
// layer rather than per expert. `lora` itself without tp.
MoeExpertLora ForTensorParallelForward(const MoeExpertLora& lora, const TensorParallel& tp);

// Expert `e`'s SwiGLU down(silu(gate x) * up x) of its tokens x [n, hidden] with its adapters
// added to each adapted projection; dropout on an adapter's input only in `training`. A
// projection in NF4 (lora.*_nf4) is dequantized on the fly instead of reading its stacked weight,
// in forward and again in backward (Nf4LinearForward).
torch::Tensor ExpertSwiGluWithLora(const torch::Tensor& x, int64_t e, const torch::Tensor& gate,
                                   const torch::Tensor& up, const torch::Tensor& down,
                                   const MoeExpertLora& lora, bool training);

}  // namespace tessera::trainer
