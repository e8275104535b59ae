// The layout planner: for a model, a batch and a cluster shape it says, before launch, how much
// memory each device of a layout needs, how fast a step will be, and which layout is best.
//
// Memory model (per device, per pipeline stage), each term reported separately:
//   * weights, gradients and AdamW state of the parameters the device holds after the tensor
//     split (vocab-parallel embedding and head, each ceil(vocab / tp) rows per rank as the trainer
//     pads the vocabulary to a multiple of tp; column/row-parallel matmuls, replicated norms) and
//     the pipeline split (embeddings on the first stage, the final norm and LM head on the last; a
//     tied head is a second copy when pp > 1), then ZeRO (1 shards optimizer states, 2 also
//     gradients, 3 also weights over the data-parallel group). Like the trainer, parameters live
//     in one flat float32 buffer per unit (each layer, and one unit for the embeddings, final
//     norm and head), padded to a multiple of dp; ZeRO 0 and 1 keep full flat gradient buffers
//     (.grad views into them, all-reduced or reduce-scattered in place), ZeRO 2 and 3 only the
//     rank's 1/dp shard. The precision policy is the trainer's: weights, gradients and the two
//     AdamW moments are float32 (16 bytes per trained parameter), plus AdamW's 4-byte step
//     counter per run it steps: each unit orders its decay parameters (matrices, embeddings,
//     head) before its no-decay ones (biases, norms), and the fused AdamW keeps one counter per
//     contiguous run of either kind, so a unit costs 8 bytes when it holds both kinds and 4 when
//     it holds one (under ZeRO >= 1 the worst dp rank's, whose shard straddles the boundary);
//     bf16 autocast adds bf16 copies of the matmul weights, kept from forward to backward
//     (`cast_weights_bytes`). LoRA trains only rank-r adapters on every block matmul (one decay
//     run per layer) and keeps the frozen base in the compute precision.
//   * activations per layer and micro-batch, counted tensor by tensor in the way of Korthikanti
//     et al. 2022 for the blocks the trainer builds (pre-norm GPT-2 and Llama/SwiGLU/GQA, no
//     dropout, float32 residual stream), with flash attention keeping O(s) instead of the a*s^2
//     scores, sequence parallelism splitting the norm regions over tp, and recomputation
//     (selective: attention core and the MLP activation function; full: only each layer's input,
//     plus one layer's worth during its recompute). A 1F1B pipeline holds min(pp - stage, m)
//     micro-batches in flight, so the first stage holds the most.
//   * logits and cross-entropy buffers on the last stage (vocab x seq x micro-batch, split over
//     tp: ceil(vocab / tp) columns per rank, like the embedding and head), communication buffers
//     (ZeRO 2/3: the full gradients of the units in flight; ZeRO-3: the gathered weights of the
//     non-layer unit and two layers; pipeline send/receive), and the device's allocator workspace
//     plus a fragmentation fraction.
//   Peak: the sum of every term; gradient buffers are allocated once and live next to the
//   activations.
//
// Step-time model: hardware FLOPs (6 x params x tokens plus attention, plus recomputation) at
// peak x achievable fraction x a small-GEMM penalty, tensor-parallel collectives per layer over
// the intra-node links (not overlapped), pipeline transfers and the 1F1B bubble (pp-1)/(m+pp-1),
// data-parallel gradient all-reduce (ZeRO-0) or reduce-scatter (ZeRO-1 once per step, ZeRO-2 per
// micro-batch) over intra- or inter-node links, overlapped with backward, then ZeRO-1/2's
// all-gather of the updated weights (exposed); ZeRO-3's gathers and reduce-scatters overlapped
// with all compute; and the optimizer's memory-bound update of the state the rank owns. Gives
// step time, tokens/s and MFU.
//
// Expert, context and interleaved pipeline parallelism (docs/planner.md):
//   * expert parallelism (ep, MoE only) splits each MoE layer's routed experts over ep ranks of the
//     data-parallel group: their weights, gradients and AdamW state are divided by ep (and sharded
//     by ZeRO over the dp/ep ranks that hold the same experts), the router and shared expert stay
//     replicated; compute follows the active parameters; each MoE layer runs two all-to-alls
//     forward (dispatch, combine) and two backward of tokens x top_k x hidden x (ep-1)/ep bytes,
//     not overlapped, over intra- or inter-node links, with send and receive buffers of that size.
//   * context parallelism (cp) splits each sequence over cp ranks: activations, logits and
//     attention FLOPs per rank are divided by cp; ring attention passes keys and values (cp-1)
//     hops per layer, 2 x kv_heads x head_dim x seq/cp elements each, once forward and twice
//     backward, hidden behind the attention compute as far as it lasts; gradients are reduced
//     and ZeRO shards over the dp x cp ranks, which hold the same weights (as Megatron-Core's
//     distributed optimizer and torchtitan's FSDP do).
//   * interleaved 1F1B (v virtual stages) shrinks the bubble to (pp-1)/(v x m) micro-batch
//     times, sends v times as many pipeline messages, and holds Megatron's warm-up count of chunk
//     micro-batches: 2 x (pp - stage - 1) + (v - 1) x pp + 1 chunks of num_layers / (pp x v)
//     layers (at most v x m).
//
// Plain C++: no LibTorch. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/layout.pb.h"
#include "tessera/v1/model.pb.h"

namespace tessera::planner {

// What is trained.
struct Workload {
  // Resolved dimensions (ResolveModel).
  v1::ModelDims dims;
  // Tokens per sequence.
  int seq_len = 0;
  // Sequences per optimizer step over the whole job.
  int64_t global_batch = 0;
  // PRECISION_BF16 (autocast over float32 weights) or PRECISION_FP32.
  v1::Precision precision = v1::PRECISION_BF16;
  // LoRA adapter rank; 0 trains every weight.
  int lora_rank = 0;
  // With LoRA: adapter parameters per transformer layer (ResolvedLora::parameters_per_layer);
  // 0 means adapters on every linear layer of the block.
  int64_t lora_layer_parameters = 0;
  // Of lora_layer_parameters, the routed experts' adapters, which expert parallelism shards like
  // the experts (planner::ExpertLoraLayerParameters).
  int64_t lora_expert_layer_parameters = 0;
  // With LoRA: the frozen base's block linear weights in NF4 (QLoRA; planner::Nf4LayerBytes).
  bool lora_base_nf4 = false;
  // Attention through a fused kernel that keeps O(seq) state (the trainer's
  // scaled_dot_product_attention picks one on CUDA and CPU alike).
  bool flash_attention = true;
};

// One fully specified layout.
struct LayoutChoice {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int zero = 0;
  int micro_batch = 1;
  bool sp = false;
  // NONE, SELECTIVE or FULL (never UNSPECIFIED here).
  v1::ActivationCheckpointing ac = v1::ACTIVATION_CHECKPOINTING_NONE;
  // Context-parallel degree (ranks a sequence is split over; they multiply the world).
  int cp = 1;
  // Expert-parallel degree: ranks of the data-parallel group the routed experts are split over.
  int ep = 1;
  // Virtual pipeline stages (interleaved 1F1B chunks per pipeline rank).
  int v = 1;

  int world() const { return dp * tp * pp * cp; }
  friend bool operator==(const LayoutChoice&, const LayoutChoice&) = default;
};

// The devices a job runs on.
struct ClusterShape {
  int gpus = 1;
  int gpus_per_node = 1;
  v1::DeviceModel device;
  // Fraction of (memory - reserved) a plan may use, in (0, 1].
  double memory_headroom = 0.9;
};

// Micro-batches per optimizer step per data-parallel rank.
int64_t GradientAccumulation(const Workload& workload, const LayoutChoice& layout);

// Why `layout` cannot run `workload` on `cluster` at all (structure, not memory), e.g.
// "tensor_parallel 3 does not divide 32 attention heads"; nullopt when it can.
std::optional<std::string> InvalidReason(const Workload& workload, const LayoutChoice& layout,
                                         const ClusterShape& cluster);

// Per-device memory of every pipeline stage (stage 0 first). Needs a structurally valid layout.
std::vector<v1::MemoryEstimate> EstimateMemory(const Workload& workload, const LayoutChoice& layout,
                                               const ClusterShape& cluster);

// Step time, tokens/s and MFU. Needs a structurally valid layout.
v1::StepTimeEstimate EstimateStepTime(const Workload& workload, const LayoutChoice& layout,
                                      const ClusterShape& cluster);

// Everything about one layout: plan (memory of the worst stage, stage_memory when pp > 1, step
// time, fits) and, when it is invalid or does not fit, rejected_reason ("does not fit: needs
// 93.1 GiB per GPU, 70.9 GiB usable (over by 22.2 GiB)").
v1::LayoutCandidate EvaluateLayout(const Workload& workload, const LayoutChoice& layout,
                                   const ClusterShape& cluster);

// What the search may choose from.
struct SearchLimits {
  // Largest degrees to consider; 0 means no limit beyond the cluster.
  int max_tp = 0;
  int max_pp = 0;
  int max_zero = 3;
  // Largest ZeRO stage when tensor_parallel > 1 or pipeline_parallel > 1 (and no more than
  // max_zero): a trainer may shard optimizer states over dp next to a model-parallel split without
  // also sharding gradients or weights.
  int max_zero_with_model_parallel = 3;
  bool allow_activation_checkpointing = true;
  bool allow_sequence_parallel = true;
  // Fixed micro-batch; 0 searches powers of two (and the per-rank batch itself).
  int micro_batch = 0;
  // Largest context-parallel degree, expert-parallel degree (mixtures of experts only) and number
  // of virtual pipeline stages (pp > 1 only); 0 means no limit beyond the cluster and the model.
  int max_cp = 0;
  int max_ep = 0;
  int max_v = 0;
  // Whether a mixture-of-experts model may be split with context parallelism.
  bool context_parallel_with_experts = true;
};

struct SearchResult {
  // Fitting layouts by estimated tokens/s (fastest first; ties: the simpler layout, i.e. lower
  // ZeRO stage, less recomputation, no sp, fewer stages, less tp; then less memory), then layouts
  // that do not fit by how much they miss, then invalid ones; each with its reason when not
  // fitting.
  std::vector<v1::LayoutCandidate> candidates;
  int fitting = 0;
};

// Micro-batches worth trying for a per-rank batch: the powers of two that divide it and the batch
// itself ({1} when there is none, for InvalidReason to report).
std::vector<int> MicroBatchChoices(int64_t per_rank);

// Orders result.candidates as SearchResult describes and counts the fitting ones.
void RankCandidates(SearchResult& result);

// Enumerates every layout of cluster.gpus devices within `limits` (tp a divisor within a node, pp,
// dp, ZeRO stage, micro-batch, sp, recomputation) and evaluates each. Layouts outside the limits
// (e.g. ZeRO above max_zero_with_model_parallel next to tp or pp) are not candidates at all.
SearchResult SearchLayouts(const Workload& workload, const ClusterShape& cluster,
                           const SearchLimits& limits);

// The plan to use from a search: the fastest fitting candidate, or, among the fitting ones of its
// tp, pp and sp estimated within 10% of its tokens/s, the one with the lowest ZeRO stage, then
// least recomputation (the estimates are uncalibrated); with an explanation naming the
// runner-up (or the fastest, when a simpler layout was preferred) and how many were considered, or
// (when none fits) the one that misses by least with fits = false and an explanation of what was
// tried.
v1::LayoutPlan ChoosePlan(const SearchResult& result, const ClusterShape& cluster);

// Conversions between the proto layout and LayoutChoice. FromProto resolves the legacy
// activation_checkpointing flag and UNSPECIFIED (as NONE); micro_batch comes from the caller.
LayoutChoice FromProto(const v1::Layout& layout, int micro_batch);
v1::Layout ToProto(const LayoutChoice& layout);

// "dp=8 tp=1 pp=1 zero=1 mb=4 sp=off ac=none", followed by " cp=2", " ep=4", " v=2" for those
// degrees above 1.
std::string Describe(const LayoutChoice& layout);
// "none", "selective", "full".
std::string ActivationCheckpointingName(v1::ActivationCheckpointing ac);
// Bytes as "93.1 GiB" / "512.0 MiB".
std::string FormatBytes(int64_t bytes);

}  // namespace tessera::planner
