#include "planner/layout_rules.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace tessera::planner {

std::optional<LayoutRuleViolation> CheckModelDivisibility(const v1::ModelDims& dims,
                                                          int tensor_parallel,
                                                          int pipeline_parallel) {
  constexpr char kTensorParallel[] = "parallelism.layout.tensor_parallel";
  const int tp = tensor_parallel;
  // A mixture of experts splits each expert's (and the shared expert's) SwiGLU width over tp, as
  // a dense model its MLP's; ffn_hidden_size is then only moe_intermediate_size's default.
  const bool moe = dims.num_experts() > 0;
  const int64_t expert_width =
      dims.moe_intermediate_size() > 0 ? dims.moe_intermediate_size() : dims.ffn_hidden_size();
  const struct {
    const char* name;
    int64_t value;
  } split_by_tp[] = {{"num_attention_heads", dims.num_attention_heads()},
                     {"num_kv_heads", dims.num_kv_heads()},
                     {moe ? "moe_intermediate_size" : "ffn_hidden_size",
                      moe ? expert_width : dims.ffn_hidden_size()},
                     {"shared_expert_intermediate_size", dims.shared_expert_intermediate_size()}};
  for (const auto& dim : split_by_tp) {
    if (dim.value % tp != 0) {
      return LayoutRuleViolation{
          kTensorParallel, absl::StrCat(tp, " does not divide the model's ", dim.name, " ",
                                        dim.value)};
    }
  }
  if (dims.num_layers() % pipeline_parallel != 0) {
    return LayoutRuleViolation{"parallelism.layout.pipeline_parallel",
                               absl::StrCat(pipeline_parallel, " does not divide the model's ",
                                            "num_layers ", dims.num_layers())};
  }
  return std::nullopt;
}

std::optional<LayoutRuleViolation> CheckSplitRules(const v1::ModelDims& dims, int seq_len,
                                                   const SplitDegrees& degrees) {
  constexpr char kContext[] = "parallelism.layout.context_parallel";
  constexpr char kExpert[] = "parallelism.layout.expert_parallel";
  constexpr char kVirtual[] = "parallelism.layout.pipeline_virtual_stages";
  const struct {
    const char* field;
    int value;
  } optional_degrees[] = {{kContext, degrees.context_parallel},
                          {kExpert, degrees.expert_parallel},
                          {kVirtual, degrees.pipeline_virtual_stages}};
  for (const auto& degree : optional_degrees) {
    if (degree.value < 0) {
      return LayoutRuleViolation{degree.field,
                                 absl::StrCat("must be >= 0 (0 means 1), got ", degree.value)};
    }
  }
  const int cp = std::max(1, degrees.context_parallel);
  const int ep = std::max(1, degrees.expert_parallel);
  const int v = std::max(1, degrees.pipeline_virtual_stages);
  // Rank i of a context-parallel group holds chunks i and 2cp-1-i, so every rank gets the same
  // share of the causal attention's work.
  if (cp > 1 && seq_len % (2 * cp) != 0) {
    return LayoutRuleViolation{
        kContext,
        absl::StrCat(cp, ": 2 x context_parallel (", 2 * cp, ") does not divide data.seq_len ",
                     seq_len, " (each sequence is split into 2 x cp causal chunks)")};
  }
  if (cp > 1 && dims.num_experts() > 0) {
    return LayoutRuleViolation{
        kContext, absl::StrCat(cp, " with a mixture-of-experts model (", dims.num_experts(),
                               " experts) is not supported: the routers' load-balancing loss "
                               "would count only a rank's part of each sequence; use 1")};
  }
  if (degrees.sequence_parallel && degrees.tensor_parallel > 1 &&
      (seq_len / cp) % degrees.tensor_parallel != 0) {
    return LayoutRuleViolation{
        "parallelism.layout.sequence_parallel",
        cp > 1 ? absl::StrCat("tensor_parallel ", degrees.tensor_parallel, " does not divide the ",
                              seq_len / cp, " tokens of each context-parallel rank (data.seq_len ",
                              seq_len, " / context_parallel ", cp, ")")
               : absl::StrCat("data.seq_len ", seq_len, " is not divisible by tensor_parallel ",
                              degrees.tensor_parallel,
                              " (sequence parallelism splits each sequence over tp)")};
  }
  if (ep > 1) {
    if (dims.num_experts() == 0) {
      return LayoutRuleViolation{
          kExpert, absl::StrCat(ep,
                                " with a dense model (num_experts 0): expert parallelism "
                                "splits a mixture of experts; use 1")};
    }
    if (dims.num_experts() % ep != 0) {
      return LayoutRuleViolation{kExpert, absl::StrCat(ep,
                                                       " does not divide the model's "
                                                       "num_experts ",
                                                       dims.num_experts())};
    }
    if (degrees.data_parallel % ep != 0) {
      return LayoutRuleViolation{
          kExpert, absl::StrCat(ep, " does not divide data_parallel ", degrees.data_parallel,
                                " (experts are split inside the data-parallel group)")};
    }
  }
  if (v > 1) {
    const int pp = degrees.pipeline_parallel;
    if (pp <= 1) {
      return LayoutRuleViolation{
          kVirtual, absl::StrCat(v, " needs pipeline_parallel > 1, got pipeline_parallel ", pp)};
    }
    const int64_t layers_per_stage = dims.num_layers() / pp;
    if (layers_per_stage % v != 0) {
      return LayoutRuleViolation{
          kVirtual, absl::StrCat(v, " does not divide the ", layers_per_stage,
                                 " layers of each pipeline stage (num_layers ", dims.num_layers(),
                                 " / pipeline_parallel ", pp, ")")};
    }
    const int64_t m = degrees.micro_batches_per_step;
    if (m > 0 && m % pp != 0) {
      return LayoutRuleViolation{
          kVirtual, absl::StrCat(v, " needs the micro-batches per step (", m,
                                 " = global batch / (micro-batch x data_parallel)) to be a "
                                 "multiple of pipeline_parallel ",
                                 pp)};
    }
  }
  return std::nullopt;
}

}  // namespace tessera::planner
