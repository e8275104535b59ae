// LoRA's rules that need no LibTorch: which linear layers a LoraSpec's target_modules name for a
// model's architecture, its defaults, and how many adapter parameters that adds per layer. Shared
// by the coordinator (validation and planning at submission) and the trainer (which builds the
// adapters from the resolved targets).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"
#include "tessera/v1/model.pb.h"

namespace tessera::planner {

// One targeted linear layer of a transformer block.
struct LoraTarget {
  // Tessera's suffix after "layers.N." without ".weight": "attn.q", "attn.qkv", "mlp.down", ...
  std::string module;
  // transformers' module path after the layer prefix: "self_attn.q_proj", "attn.c_attn", ...
  std::string hf_module;
  int64_t in = 0;
  int64_t out = 0;
  // An MoE layer's expert projection ("mlp.experts.gate", hf_module
  // "mlp.experts.gate_proj" standing for every "mlp.experts.E.gate_proj"): one adapter per
  // expert, `experts` of them. 1 for an ordinary layer.
  int64_t experts = 1;
};

struct ResolvedLora {
  int rank = 0;
  double alpha = 0;  // 2 * rank when the spec says 0
  double dropout = 0;
  // In the block's order.
  std::vector<LoraTarget> targets;
  // target_modules as PEFT's adapter_config.json lists them (transformers' leaf names, or
  // "attn.c_proj" / "mlp.c_proj" for GPT-2's two c_proj).
  std::vector<std::string> peft_target_modules;
  // Adapter parameters of one transformer layer: sum of rank * (in + out) * experts over the
  // targets.
  int64_t parameters_per_layer = 0;
  // QLoRA (base_quantization NF4): every linear weight of the blocks is held in NF4 (in a
  // mixture-of-experts block the attention and the routed experts; not the router).
  bool base_nf4 = false;
};

// Bytes of a weight of `numel` values in NF4 with double quantization as the trainer holds it
// (trainer/model/nf4.h): 4-bit codes (ceil(numel / 2) bytes), one 8-bit absmax per block of 64
// values, one float32 scale per 256 absmaxes and one float32 offset: about 0.5 + 1/64 + 4/16384
// bytes per weight, QLoRA's 4.127 bits.
int64_t Nf4WeightBytes(int64_t numel);

// Bytes of one transformer layer's linear weights in NF4 (each weight quantized on its own), for a
// model of resolved `dims`: every block linear weight of a dense model; the attention's of a
// mixture-of-experts model (its router and shared experts stay in float32, its routed experts are
// Nf4ExpertLayerBytes').
int64_t Nf4LayerBytes(const v1::ModelDims& dims);

// How many weights Nf4LayerBytes covers.
int64_t Nf4LayerWeights(const v1::ModelDims& dims);

// Bytes of one mixture-of-experts layer's routed experts in NF4 on one of `ep` expert-parallel
// ranks (num_experts / ep experts, each projection of each expert quantized on its own); 0 for a
// dense model.
int64_t Nf4ExpertLayerBytes(const v1::ModelDims& dims, int ep);

// Of `lora`.parameters_per_layer, the routed experts' adapters (sharded over expert parallelism
// like the experts).
int64_t ExpertLoraLayerParameters(const ResolvedLora& lora);

// Every linear layer of a block of `dims` architecture that LoRA can adapt, in the block order
// (for a mixture-of-experts model the experts' projections, each adapter per expert; not the
// router).
std::vector<LoraTarget> LoraCandidates(const v1::ModelDims& dims);

// INVALID_ARGUMENT naming the field ("lora.rank: must be > 0", "lora.base_quantization: ...
// needs lora.rank > 0" for NF4 without adapters, "lora.target_modules: 'x' is not
// a linear layer of a llama block; known: q_proj, ...") for a spec that cannot be trained.
// `dims` must be resolved (ResolveModel). An empty target list means every linear layer.
absl::StatusOr<ResolvedLora> ResolveLora(const v1::LoraSpec& spec, const v1::ModelDims& dims);

// A resolved LoRA as a plan carries it (LayoutPlan.lora), and back: the coordinator resolves a
// spec's lora once, at submission, and the planner and the trainer read the plan's.
v1::LoraPlan ToLoraPlan(const ResolvedLora& lora);
ResolvedLora FromLoraPlan(const v1::LoraPlan& plan);

}  // namespace tessera::planner
