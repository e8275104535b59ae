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
};

// Every linear layer of a block of `dims` architecture that LoRA can adapt, in the block order
// (for a mixture-of-experts model the experts' projections, each adapter per expert; not the
// router).
std::vector<LoraTarget> LoraCandidates(const v1::ModelDims& dims);

// INVALID_ARGUMENT naming the field ("lora.rank: must be > 0", "lora.target_modules: 'x' is not
// a linear layer of a llama block; known: q_proj, ...") for a spec that cannot be trained.
// `dims` must be resolved (ResolveModel). An empty target list means every linear layer.
absl::StatusOr<ResolvedLora> ResolveLora(const v1::LoraSpec& spec, const v1::ModelDims& dims);

}  // namespace tessera::planner
