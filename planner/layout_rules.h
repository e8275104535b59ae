// The layout rules that depend on the model and the data alone, in one place: which tensor-,
// pipeline-, context- and expert-parallel degrees and virtual pipeline stages its dimensions and
// sequence length allow. The coordinator's validation, the layout search and the trainer all ask
// here, so a rule (and its message) changes once. (The defaults a spec leaves open are
// training_settings.h's.)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "tessera/v1/model.pb.h"

namespace tessera::planner {

// A rule a layout breaks: the spec field at fault and what is wrong with it.
struct LayoutRuleViolation {
  std::string field;    // e.g. "parallelism.layout.tensor_parallel"
  std::string problem;  // e.g. "3 does not divide the model's num_attention_heads 32"

  // "<field>: <problem>", the form of every validation error.
  std::string ToString() const { return field + ": " + problem; }
};

// Tensor parallelism splits attention heads, key/value heads and the MLP's hidden width, so
// `tensor_parallel` must divide each; pipeline parallelism gives each stage whole layers, so
// `pipeline_parallel` must divide num_layers. A mixture-of-experts model (num_experts > 0) splits
// each routed expert's width (moe_intermediate_size, ffn_hidden_size when 0) and the shared
// expert's (shared_expert_intermediate_size) over tp instead of ffn_hidden_size (Megatron-Core's
// expert tensor parallelism at size tp). Degrees must be >= 1 (checked by the caller).
std::optional<LayoutRuleViolation> CheckModelDivisibility(const v1::ModelDims& dims,
                                                          int tensor_parallel,
                                                          int pipeline_parallel);

// The degrees of context, expert and interleaved pipeline parallelism next to the data and
// pipeline degrees they depend on, as a Layout states them (0 means 1 for cp, ep and v).
struct SplitDegrees {
  int data_parallel = 1;
  int pipeline_parallel = 1;
  int context_parallel = 0;
  int expert_parallel = 0;
  int pipeline_virtual_stages = 0;
  int tensor_parallel = 1;
  bool sequence_parallel = false;
  // Micro-batches per optimizer step per data-parallel rank (global batch / (micro-batch x dp));
  // 0 when not known yet.
  int64_t micro_batches_per_step = 0;
};

// The rules of context, expert and interleaved pipeline parallelism, for a model of `dims` trained
// on sequences of `seq_len` tokens:
//   * context_parallel, expert_parallel and pipeline_virtual_stages are >= 0 (0 means 1);
//   * context parallelism splits each sequence into 2 x cp load-balanced causal chunks, so 2 x cp
//     must divide seq_len; and it does not run a mixture of experts (the routers' load-balancing
//     loss would see a rank's chunks only);
//   * expert parallelism splits the routed experts over ep ranks of the data-parallel group: the
//     model must be a mixture of experts, and ep must divide num_experts and data_parallel;
//   * with sequence parallelism, tensor_parallel must divide seq_len / cp (each rank's chunk of
//     the sequence, the whole sequence without cp, is split again over tp);
//   * interleaving gives each pipeline rank v chunks of whole layers: v > 1 needs
//     pipeline_parallel > 1, v must divide num_layers / pipeline_parallel, and the micro-batches
//     per step must be a multiple of pipeline_parallel (the interleaved schedule runs them in
//     groups of pp, as Megatron-Core's does).
// data_parallel and pipeline_parallel must be >= 1 and pipeline_parallel must divide num_layers
// (CheckModelDivisibility); the first violation in the order above is returned.
std::optional<LayoutRuleViolation> CheckSplitRules(const v1::ModelDims& dims, int seq_len,
                                                   const SplitDegrees& degrees);

}  // namespace tessera::planner
