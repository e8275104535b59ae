#include "planner/lora.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera::planner {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("lora.", field, ": ", problem));
}

bool IsGpt2(const v1::ModelDims& dims) { return dims.architecture() == v1::ARCHITECTURE_GPT2; }

// The names a target answers to in target_modules: transformers' leaf name, its module path
// after the layer prefix, and Tessera's module suffix.
std::vector<std::string> NamesOf(const LoraTarget& target) {
  std::vector<std::string> names = {target.module, target.hf_module};
  const size_t dot = target.hf_module.rfind('.');
  names.push_back(dot == std::string::npos ? target.hf_module : target.hf_module.substr(dot + 1));
  return names;
}

}  // namespace

std::vector<LoraTarget> LoraCandidates(const v1::ModelDims& dims) {
  const int64_t d = dims.hidden_size(), f = dims.ffn_hidden_size();
  if (IsGpt2(dims)) {
    return {{"attn.qkv", "attn.c_attn", d, 3 * d},
            {"attn.proj", "attn.c_proj", d, d},
            {"mlp.fc", "mlp.c_fc", d, f},
            {"mlp.proj", "mlp.c_proj", f, d}};
  }
  const int64_t q = int64_t{dims.num_attention_heads()} * dims.head_dim();
  const int64_t kv = int64_t{dims.num_kv_heads()} * dims.head_dim();
  std::vector<LoraTarget> targets = {{"attn.q", "self_attn.q_proj", d, q},
                                     {"attn.k", "self_attn.k_proj", d, kv},
                                     {"attn.v", "self_attn.v_proj", d, kv},
                                     {"attn.o", "self_attn.o_proj", q, d}};
  if (dims.num_experts() > 0) {
    // Every expert gets its own adapters, under transformers' per-expert modules (Mixtral's
    // w1/w3/w2 are gate/up/down). The router is no target.
    const int64_t e = dims.num_experts();
    const int64_t w = dims.moe_intermediate_size() > 0 ? dims.moe_intermediate_size() : f;
    const bool mixtral = !dims.qk_norm();
    const std::string block = mixtral ? "block_sparse_moe.experts." : "mlp.experts.";
    targets.insert(targets.end(),
                   {{"mlp.experts.gate", block + (mixtral ? "w1" : "gate_proj"), d, w, e},
                    {"mlp.experts.up", block + (mixtral ? "w3" : "up_proj"), d, w, e},
                    {"mlp.experts.down", block + (mixtral ? "w2" : "down_proj"), w, d, e}});
    return targets;
  }
  targets.insert(targets.end(), {{"mlp.gate", "mlp.gate_proj", d, f},
                                 {"mlp.up", "mlp.up_proj", d, f},
                                 {"mlp.down", "mlp.down_proj", f, d}});
  return targets;
}

int64_t Nf4WeightBytes(int64_t numel) {
  // trainer/model/nf4.h's block sizes.
  constexpr int64_t kBlock = 64, kAbsmaxBlock = 256;
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  return (numel + 1) / 2 + blocks + 4 * ((blocks + kAbsmaxBlock - 1) / kAbsmaxBlock) + 4;
}

int64_t Nf4LayerBytes(const v1::ModelDims& dims) {
  int64_t bytes = 0;
  for (const LoraTarget& target : LoraCandidates(dims)) {
    if (target.experts == 1) bytes += Nf4WeightBytes(target.in * target.out);
  }
  return bytes;
}

int64_t Nf4LayerWeights(const v1::ModelDims& dims) {
  int64_t weights = 0;
  for (const LoraTarget& target : LoraCandidates(dims)) {
    if (target.experts == 1) weights += target.in * target.out;
  }
  return weights;
}

int64_t Nf4ExpertLayerBytes(const v1::ModelDims& dims, int ep) {
  int64_t bytes = 0;
  for (const LoraTarget& target : LoraCandidates(dims)) {
    // Each expert's projection is quantized on its own (trainer/model/moe_lora.h).
    if (target.experts > 1) {
      bytes += target.experts / std::max(ep, 1) * Nf4WeightBytes(target.in * target.out);
    }
  }
  return bytes;
}

int64_t ExpertLoraLayerParameters(const ResolvedLora& lora) {
  int64_t parameters = 0;
  for (const LoraTarget& target : lora.targets) {
    if (target.experts == 1) continue;
    parameters += int64_t{lora.rank} * (target.in + target.out) * target.experts;
  }
  return parameters;
}

absl::StatusOr<ResolvedLora> ResolveLora(const v1::LoraSpec& spec, const v1::ModelDims& dims) {
  ResolvedLora out;
  if (!v1::LoraBaseQuantization_IsValid(spec.base_quantization())) {
    return Invalid("base_quantization",
                   absl::StrCat("unknown value ", static_cast<int>(spec.base_quantization())));
  }
  out.base_nf4 = spec.base_quantization() == v1::LORA_BASE_QUANTIZATION_NF4;
  if (out.base_nf4 && spec.rank() <= 0) {
    return Invalid("base_quantization",
                   absl::StrCat("NF4 quantizes the frozen base under LoRA adapters and needs "
                                "lora.rank > 0, got ",
                                spec.rank()));
  }
  if (spec.rank() <= 0) return Invalid("rank", absl::StrCat("must be > 0, got ", spec.rank()));
  if (!std::isfinite(spec.alpha()) || spec.alpha() < 0) {
    return Invalid("alpha", absl::StrCat("must be >= 0 (0 for 2 * rank), got ", spec.alpha()));
  }
  if (!std::isfinite(spec.dropout()) || spec.dropout() < 0 || spec.dropout() >= 1) {
    return Invalid("dropout", absl::StrCat("must be in [0, 1), got ", spec.dropout()));
  }
  out.rank = spec.rank();
  out.alpha = spec.alpha() > 0 ? spec.alpha() : 2.0 * spec.rank();
  out.dropout = spec.dropout();
  const std::vector<LoraTarget> candidates = LoraCandidates(dims);
  std::set<std::string> chosen;
  bool all = spec.target_modules().empty();
  for (const std::string& name : spec.target_modules()) {
    if (name == "all-linear") {
      all = true;
      continue;
    }
    bool matched = false;
    for (const LoraTarget& target : candidates) {
      for (const std::string& alias : NamesOf(target)) {
        if (alias == name) {
          chosen.insert(target.module);
          matched = true;
        }
      }
    }
    if (!matched) {
      std::vector<std::string> known;
      for (const LoraTarget& target : candidates) known.push_back(NamesOf(target)[2]);
      if (IsGpt2(dims)) known = {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "c_proj"};
      known.push_back("all-linear");
      return Invalid("target_modules",
                     absl::StrCat("'", name, "' is not a linear layer of a ",
                                  IsGpt2(dims) ? "GPT-2" : "Llama", " block; known: ",
                                  absl::StrJoin(known, ", ")));
    }
  }
  for (const LoraTarget& target : candidates) {
    if (!all && !chosen.contains(target.module)) continue;
    out.targets.push_back(target);
    out.parameters_per_layer += int64_t{out.rank} * (target.in + target.out) * target.experts;
    // PEFT matches a target_modules entry against the end of a module's path; GPT-2's two
    // c_proj need their parent to tell them apart.
    out.peft_target_modules.push_back(IsGpt2(dims) ? target.hf_module : NamesOf(target)[2]);
  }
  return out;
}

v1::LoraPlan ToLoraPlan(const ResolvedLora& lora) {
  v1::LoraPlan plan;
  plan.set_rank(lora.rank);
  plan.set_alpha(lora.alpha);
  plan.set_dropout(lora.dropout);
  for (const LoraTarget& target : lora.targets) {
    v1::LoraPlanTarget* out = plan.add_targets();
    out->set_module(target.module);
    out->set_hf_module(target.hf_module);
    out->set_in_features(target.in);
    out->set_out_features(target.out);
    out->set_experts(target.experts);
  }
  for (const std::string& module : lora.peft_target_modules) plan.add_peft_target_modules(module);
  plan.set_parameters_per_layer(lora.parameters_per_layer);
  plan.set_base_nf4(lora.base_nf4);
  return plan;
}

ResolvedLora FromLoraPlan(const v1::LoraPlan& plan) {
  ResolvedLora lora;
  lora.rank = plan.rank();
  lora.alpha = plan.alpha();
  lora.dropout = plan.dropout();
  for (const v1::LoraPlanTarget& target : plan.targets()) {
    lora.targets.push_back({.module = target.module(),
                            .hf_module = target.hf_module(),
                            .in = target.in_features(),
                            .out = target.out_features(),
                            .experts = target.experts()});
  }
  lora.peft_target_modules.assign(plan.peft_target_modules().begin(),
                                  plan.peft_target_modules().end());
  lora.parameters_per_layer = plan.parameters_per_layer();
  lora.base_nf4 = plan.base_nf4();
  return lora;
}

}  // namespace tessera::planner
