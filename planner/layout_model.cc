// The memory and step-time models of layout_planner.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "planner/devices.h"
#include "planner/layout_planner.h"
#include "planner/lora.h"
#include "planner/layout_rules.h"
#include "planner/model_config.h"

namespace tessera::planner {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// Granularity of the latency term of a collective: bytes per NCCL/Gloo call (PyTorch DDP's default
// bucket size). The trainer communicates per unit (a layer, or the embeddings and head); a unit
// larger than this is counted as several calls.
constexpr int64_t kBucketBytes = 25 * kMiB;
// Latency of one collective or transfer on NVLink / a network, seconds.
constexpr double kCollectiveLatency = 20e-6;
// Share of communication that hides behind the compute it overlaps with.
constexpr double kOverlapEfficiency = 0.8;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool IsLlama(const v1::ModelDims& dims) { return dims.architecture() == v1::ARCHITECTURE_LLAMA; }

bool IsMoe(const v1::ModelDims& dims) { return dims.num_experts() > 0; }

// Parameters of one device, split by where they live. Counts are per tensor-parallel rank.
struct ParameterSplit {
  // One transformer layer: matmul weights (and column-parallel biases) split over tp.
  int64_t layer_sharded = 0;
  // One layer: norms and row-parallel biases, replicated over tp.
  int64_t layer_replicated = 0;
  // One layer: matmul weights only (what autocast casts to bf16).
  int64_t layer_matmul = 0;
  // One layer: LoRA adapter parameters (rank r on every block matmul), per tp rank.
  int64_t layer_lora = 0;
  // One MoE layer: the routed experts this rank holds (num_experts / ep of them), not part of
  // the counts above: their state is sharded over the dp / ep ranks that hold the same experts.
  int64_t layer_expert = 0;
  // One MoE layer under LoRA: the adapters of the routed experts this rank holds, not part of
  // layer_lora: like the experts, their state is sharded over the ranks holding the same experts.
  int64_t layer_expert_lora = 0;
  // Token embedding (vocab-parallel) and, for GPT-2, learned positions (replicated).
  int64_t token_embedding = 0;
  int64_t position_embedding = 0;
  // Final norm and the LM head (vocab-parallel).
  int64_t final_norm = 0;
  int64_t lm_head = 0;
};

ParameterSplit SplitParameters(const Workload& w, int tp, int ep) {
  const v1::ModelDims& m = w.dims;
  const int64_t d = m.hidden_size(), f = m.ffn_hidden_size(), v = m.vocab_size();
  const int64_t r = w.lora_rank;
  ParameterSplit p;
  if (IsLlama(m)) {
    const int64_t hd = m.head_dim();
    const int64_t q = m.num_attention_heads() * hd, kv = m.num_kv_heads() * hd;
    // A MoE layer's MLP: the router and the shared expert (with its gate) are replicated over
    // the expert-parallel ranks; the routed experts are split over them. Over tp the shared
    // expert and every routed expert split their width like the dense MLP (expert tensor
    // parallelism), while the router and the shared expert's sigmoid gate stay whole.
    const int64_t shared = m.shared_expert_intermediate_size();
    const int64_t mlp = IsMoe(m) ? 3 * d * shared : 3 * d * f;
    const int64_t mlp_replicated = IsMoe(m) ? m.num_experts() * d + (shared > 0 ? d : 0) : 0;
    p.layer_matmul = CeilDiv(d * q + 2 * d * kv + q * d + mlp, tp) + mlp_replicated;
    if (IsMoe(m)) {
      p.layer_expert =
          CeilDiv(m.num_experts() / ep * 3 * d * int64_t{m.moe_intermediate_size()}, tp);
    }
    p.layer_sharded = p.layer_matmul;
    p.layer_replicated = 2 * d + (m.qk_norm() ? 2 * hd : 0);
    p.layer_lora = CeilDiv(r * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d)), tp);
    p.final_norm = d;
  } else {
    p.layer_matmul = CeilDiv(3 * d * d + d * d + 2 * d * f, tp);
    p.layer_sharded = p.layer_matmul + CeilDiv(3 * d + f, tp);  // qkv and fc biases
    p.layer_replicated = 2 * d + 2 * d + 2 * d;                 // two layer norms, two row biases
    p.layer_lora = CeilDiv(r * ((d + 3 * d) + (d + d) + (d + f) + (f + d)), tp);
    p.position_embedding = int64_t{m.max_seq_len()} * d;
    p.final_norm = 2 * d;
  }
  if (w.lora_layer_parameters > 0) {
    // The experts' adapters are split over ep with their experts.
    const int64_t experts = w.lora_expert_layer_parameters;
    p.layer_lora = CeilDiv(w.lora_layer_parameters - experts, tp);
    p.layer_expert_lora = experts / ep;
  }
  // Vocab-parallel: the trainer pads the vocabulary to a multiple of tp, so each rank holds
  // ceil(v / tp) whole rows of the embedding and of the head.
  p.token_embedding = CeilDiv(v, tp) * d;
  p.lm_head = CeilDiv(v, tp) * d;
  return p;
}

// Parameters one device of `stage` holds, split into what AdamW trains.
struct StageParameters {
  int64_t all = 0;        // every parameter held
  int64_t matmul = 0;     // matmul weights (bf16-cast by autocast)
  int64_t trainable = 0;  // parameters with gradients and optimizer state
  int64_t frozen = 0;     // LoRA's base weights
  int64_t embedding = 0;  // embedding tables and LM head (subset of `all`)
  // The trainer's units: each transformer layer of the stage, plus one unit for everything else
  // it holds (embeddings, final norm, LM head; none on a middle pipeline stage). Parameters are
  // kept in one flat float32 buffer per unit, padded to a multiple of dp.
  int64_t layers = 0;
  int64_t layer_trainable = 0;  // one layer's trainable parameters
  int64_t layer_frozen = 0;     // one layer's frozen (LoRA base) parameters
  // QLoRA: of layer_frozen, the linear weights held in NF4, and their bytes.
  int64_t layer_nf4_weights = 0;
  int64_t layer_nf4_bytes = 0;
  int64_t rest_trainable = 0;   // the non-layer unit's
  int64_t rest_frozen = 0;
  // Routed expert parameters of the stage's MoE layers on this rank (ParameterSplit::layer_expert
  // per layer); counted in `all` and `matmul`, not in `trainable` or `frozen`. Trained unless
  // LoRA freezes the base.
  int64_t experts = 0;
  int64_t layer_experts = 0;
  // QLoRA: one layer's routed experts on this rank in NF4, bytes (0: not in NF4).
  int64_t layer_expert_nf4_bytes = 0;
  // LoRA: the adapters of the routed experts on this rank (trained, in float32).
  int64_t expert_lora = 0;
  // AdamW step counters (one float32 each) of the worst dp rank. Within a unit the trainer orders
  // the trainable decay parameters (matrices, embeddings, head: dim >= 2) before the no-decay ones
  // (biases, norms), and its fused AdamW keeps one counter per contiguous run of either kind that a
  // rank steps: per unit, one per kind it holds under ZeRO 0 (the whole unit), and as many on the
  // rank whose 1/dp shard straddles the boundary under ZeRO >= 1. So 2 for a unit holding both
  // kinds, 1 for one kind, 0 for an empty unit.
  int64_t step_counters = 0;
};

StageParameters ParametersOfStage(const Workload& w, const LayoutChoice& l, int stage) {
  const ParameterSplit p = SplitParameters(w, l.tp, l.ep);
  const int64_t layers = w.dims.num_layers() / l.pp;
  const bool first = stage == 0, last = stage == l.pp - 1;
  StageParameters s;
  int64_t base = layers * (p.layer_sharded + p.layer_replicated);
  s.matmul = layers * p.layer_matmul;
  s.layers = layers;
  const int64_t layer_all = p.layer_sharded + p.layer_replicated;
  if (first) {
    s.embedding += p.token_embedding + p.position_embedding;
  }
  if (last) {
    base += p.final_norm;
    // An untied head is its own matrix; a tied one is the embedding itself when one stage holds
    // both ends, and a second copy on the last stage of a pipeline.
    if (!w.dims.tie_embeddings() || l.pp > 1) {
      s.embedding += p.lm_head;
    }
    s.matmul += p.lm_head;  // the head matmul is cast whether tied or not
  }
  base += s.embedding;
  auto kinds = [](int64_t decay, int64_t no_decay) {
    return (decay > 0 ? 1 : 0) + (no_decay > 0 ? 1 : 0);
  };
  if (w.lora_rank > 0) {
    s.frozen = base;
    s.trainable = layers * p.layer_lora;
    s.matmul = 0;  // the frozen base is stored in the compute precision already
    s.layer_trainable = p.layer_lora;
    s.layer_frozen = layer_all;
    if (w.lora_base_nf4) {
      // A mixture-of-experts layer's router and shared experts stay in float32.
      s.layer_nf4_weights = IsMoe(w.dims) ? Nf4LayerWeights(w.dims) : p.layer_matmul;
      s.layer_nf4_bytes = Nf4LayerBytes(w.dims);
      s.layer_expert_nf4_bytes = Nf4ExpertLayerBytes(w.dims, l.ep);
    }
    // Only the adapters train, and they are matrices: one decay run per layer, none outside.
    // The experts' adapters form a unit of their own per layer (the engine's expert units).
    s.step_counters = layers * (kinds(p.layer_lora, 0) + kinds(p.layer_expert_lora, 0));
    s.expert_lora = layers * p.layer_expert_lora;
  } else {
    s.trainable = base;
    s.layer_trainable = layer_all;
    // A layer: matmul weights, then biases and norms. The non-layer unit: embeddings and head,
    // then the final norm (on the last stage).
    s.step_counters = layers * kinds(p.layer_matmul, layer_all - p.layer_matmul) +
                      kinds(s.embedding, last ? p.final_norm : 0);
  }
  s.layer_experts = p.layer_expert;
  s.experts = layers * p.layer_expert;
  if (w.lora_rank == 0) s.matmul += s.experts;
  s.all = s.frozen + s.trainable + s.experts + s.expert_lora;
  s.rest_trainable = s.trainable - layers * s.layer_trainable;
  s.rest_frozen = s.frozen - layers * s.layer_frozen;
  return s;
}

int ActivationBytes(const Workload& w) { return w.precision == v1::PRECISION_FP32 ? 4 : 2; }

struct LayerActivations {
  // Bytes kept for backward by one layer for one micro-batch, under the layout's recomputation.
  int64_t kept = 0;
  // Bytes one layer holds without any recomputation (re-materialised during a full recompute).
  int64_t full = 0;
};

LayerActivations ActivationsPerLayer(const Workload& w, const LayoutChoice& l) {
  const v1::ModelDims& m = w.dims;
  // Context parallelism: each rank holds seq_len / cp tokens of every sequence.
  const double s = static_cast<double>(w.seq_len) / l.cp, b = l.micro_batch;
  const double h = m.hidden_size();
  // The MLP's inner width per token: a MoE layer runs top_k routed experts and the shared one.
  const double f =
      IsMoe(m) ? static_cast<double>(m.num_experts_per_token()) * m.moe_intermediate_size() +
                     m.shared_expert_intermediate_size()
               : m.ffn_hidden_size();
  const double t = l.tp, a = m.num_attention_heads();
  const double q = a * m.head_dim(), kv = static_cast<double>(m.num_kv_heads()) * m.head_dim();
  const double e = ActivationBytes(w);  // matmul inputs, attention tensors, MLP intermediates
  const double r = 4;                   // residual stream and norm inputs stay float32
  const double split = l.sp ? t : 1;    // sequence parallelism splits the norm regions
  // Norm regions: each of the two norms keeps its float32 input and per-token statistics (mean
  // and rstd, or rstd), and the next matmul keeps the normalised input in compute precision.
  const double norm_stats = IsLlama(m) ? 4 : 8;
  const double norms = 2 * (s * b * h * (r + e) + s * b * norm_stats) / split;
  // Attention: q, k, v (kept by the attention kernel), its output (kept by the kernel and, after
  // the head transpose, again by the output projection), and the per-head log-sum-exp.
  double attention = s * b * (q + 2 * kv) * e / t + 2 * s * b * q * e / t;
  if (m.qk_norm()) attention += s * b * (q + kv) * e / t;  // q_norm/k_norm inputs
  double scores = 0;
  if (w.flash_attention) {
    attention += s * b * a * 4 / t;
  } else {
    // Softmax output in float32 plus its compute-precision copy for the second matmul.
    scores = a * s * s * b * (w.precision == v1::PRECISION_FP32 ? 4 : 4 + e) / t;
  }
  // MLP intermediates: GPT-2 keeps the fc output (GELU input) and GELU output; ATen's composite
  // SwiGLU keeps gate, up, silu(gate) and the product. The trainer's fused SwiGLU (CUDA, and
  // float32 CPU) keeps no silu(gate), one tensor less; the model keeps four because on the one
  // GPU measurement so far (qwen3-0.6b on an H200) it predicted 24.23 GiB for 23.38 measured,
  // and three would predict 22.92: something else is under-counted, not yet found.
  const double mlp_tensors = IsLlama(m) ? 4 : 2;
  const double mlp_recomputable = IsLlama(m) ? 2 : 1;  // activation function outputs
  // A MoE layer also keeps the float32 router logits and probabilities (num_experts per token),
  // and each token's top_k copies of its input permuted to the experts and of the experts'
  // outputs before they are combined.
  const double routing =
      IsMoe(m) ? s * b * (2.0 * m.num_experts() * 4 + 2.0 * m.num_experts_per_token() * h * e) : 0;
  const double mlp = mlp_tensors * s * b * f * e / t + routing;
  LayerActivations out;
  out.full = static_cast<int64_t>(norms + attention + scores + mlp);
  switch (l.ac) {
    case v1::ACTIVATION_CHECKPOINTING_FULL:
      out.kept = static_cast<int64_t>(s * b * h * r / split);
      break;
    case v1::ACTIVATION_CHECKPOINTING_SELECTIVE:
      out.kept = static_cast<int64_t>(norms + attention + routing +
                                      (mlp_tensors - mlp_recomputable) * s * b * f * e / t);
      break;
    default:
      out.kept = out.full;
  }
  return out;
}

int InFlightMicroBatches(const LayoutChoice& l, int64_t accumulation, int stage) {
  return static_cast<int>(std::min<int64_t>(l.pp - stage, accumulation));
}

// Interleaved 1F1B: chunk micro-batches (each num_layers / (pp x v) layers) whose activations a
// stage holds at its peak: Megatron's warm-up count 2 x (pp - stage - 1) + (v - 1) x pp, plus the
// one in its steady state, at most every chunk micro-batch of the step (v x m). On the first
// stage that is the pp x (1 + (pp - 1) / (pp x v)) micro-batches' worth of Korthikanti et al.
int64_t InFlightChunks(const LayoutChoice& l, int64_t accumulation, int stage) {
  const int64_t warmup = 2 * int64_t{l.pp - stage - 1} + int64_t{l.v - 1} * l.pp;
  return std::min<int64_t>(warmup + 1, int64_t{l.v} * accumulation);
}

// Size factor of matmul efficiency: small GEMMs (few tokens per micro-batch, narrow tp shards)
// reach less of the peak. 1 for large shapes.
double GemmEfficiency(const Workload& w, const LayoutChoice& l) {
  const double tokens = static_cast<double>(w.seq_len) / l.cp * l.micro_batch;
  const double width = static_cast<double>(w.dims.hidden_size()) / l.tp;
  return tokens / (tokens + 512) * width / (width + 256);
}

// Ring all-reduce of `bytes` over `n` ranks at `bandwidth` (each way).
double AllReduceSeconds(double bytes, int n, double bandwidth) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) / n * bytes / bandwidth +
         kCollectiveLatency * std::ceil(bytes / kBucketBytes);
}

// Reduce-scatter or all-gather of `bytes` (the full size) over `n` ranks.
double HalfRingSeconds(double bytes, int n, double bandwidth) {
  if (n <= 1 || bytes <= 0) return 0;
  return 1.0 * (n - 1) / n * bytes / bandwidth +
         kCollectiveLatency * std::ceil(bytes / kBucketBytes);
}

// The mesh orders ranks pp, dp, cp, tp (tp fastest; trainer/parallel/mesh.h), and an
// expert-parallel group is ep neighbouring ranks of a data-parallel group.
// Whether a data-parallel group (and the dp x cp group gradients are reduced over) stays inside a
// node.
bool DataParallelInsideNode(const LayoutChoice& l, const ClusterShape& c) {
  return int64_t{l.tp} * l.cp * l.dp <= c.gpus_per_node;
}

bool PipelineInsideNode(const LayoutChoice& l, const ClusterShape& c) {
  return int64_t{l.tp} * l.cp * l.dp * l.pp <= c.gpus_per_node;
}

bool ContextParallelInsideNode(const LayoutChoice& l, const ClusterShape& c) {
  return int64_t{l.tp} * l.cp <= c.gpus_per_node;
}

bool ExpertParallelInsideNode(const LayoutChoice& l, const ClusterShape& c) {
  return int64_t{l.tp} * l.cp * l.ep <= c.gpus_per_node;
}

// What the trainer does for `l`: ZeRO over a single data-parallel rank (and no context-parallel
// peers) shards nothing and gathers nothing, so it runs as ZeRO-0.
LayoutChoice Effective(LayoutChoice l) {
  if (l.dp * l.cp == 1) l.zero = 0;
  return l;
}

// One key/value block of ring attention: 2 x kv_heads x head_dim x seq/cp x micro-batch elements.
double RingBlockBytes(const Workload& w, const LayoutChoice& l) {
  const v1::ModelDims& m = w.dims;
  return 2.0 * m.num_kv_heads() * m.head_dim() * (static_cast<double>(w.seq_len) / l.cp) *
         l.micro_batch * ActivationBytes(w) / l.tp;
}

// One all-to-all's share of a rank's tokens that leaves it: tokens x top_k x hidden x (ep-1)/ep.
double AllToAllBytes(const Workload& w, const LayoutChoice& l) {
  if (!IsMoe(w.dims) || l.ep <= 1) return 0;
  const double tokens = static_cast<double>(w.seq_len) / l.cp * l.micro_batch;
  return tokens * w.dims.num_experts_per_token() * w.dims.hidden_size() * ActivationBytes(w) *
         (l.ep - 1) / l.ep;
}

}  // namespace

int64_t GradientAccumulation(const Workload& w, const LayoutChoice& l) {
  const int64_t per_step = int64_t{l.micro_batch} * l.dp;
  return per_step > 0 ? w.global_batch / per_step : 0;
}

std::optional<std::string> InvalidReason(const Workload& w, const LayoutChoice& l,
                                         const ClusterShape& c) {
  const v1::ModelDims& m = w.dims;
  if (l.dp < 1 || l.tp < 1 || l.pp < 1 || l.cp < 1 || l.ep < 1 || l.v < 1) {
    return "every degree must be >= 1";
  }
  if (l.world() != c.gpus) {
    return absl::StrCat("dp ", l.dp, " x tp ", l.tp, " x pp ", l.pp,
                        l.cp > 1 ? absl::StrCat(" x cp ", l.cp) : "", " = ", l.world(),
                        " != ", c.gpus, " devices");
  }
  if (const auto violation = CheckModelDivisibility(m, l.tp, l.pp)) return violation->ToString();
  if (const auto violation =
          CheckSplitRules(m, w.seq_len,
                          {.data_parallel = l.dp,
                           .pipeline_parallel = l.pp,
                           .context_parallel = l.cp,
                           .expert_parallel = l.ep,
                           .pipeline_virtual_stages = l.v,
                           .tensor_parallel = l.tp,
                           .sequence_parallel = l.sp,
                           .micro_batches_per_step = GradientAccumulation(w, l)})) {
    return violation->ToString();
  }
  if (l.tp > c.gpus_per_node) {
    return absl::StrCat("tensor_parallel ", l.tp, " exceeds the ", c.gpus_per_node,
                        " devices of a node (tensor-parallel groups stay inside a node)");
  }
  // zero_stage > 0 at data_parallel 1 shards over one rank: valid, and the same as zero_stage 0
  // in memory (NeMo's distributed optimizer accepts it too).
  if (l.zero < 0 || l.zero > 3) return absl::StrCat("zero_stage ", l.zero, " is not in 0..3");
  if (l.sp && l.tp == 1) return "sequence_parallel needs tensor_parallel > 1";
  if (l.micro_batch < 1) return absl::StrCat("micro_batch ", l.micro_batch, " must be >= 1");
  const int64_t per_step = int64_t{l.micro_batch} * l.dp;
  if (w.global_batch % per_step != 0) {
    return absl::StrCat("global batch ", w.global_batch, " is not divisible by micro_batch ",
                        l.micro_batch, " x data_parallel ", l.dp, " (= ", per_step, ")");
  }
  if (w.precision == v1::PRECISION_BF16 && IsCpu(c.device)) {
    return "bf16 needs a GPU; CPU trainers run fp32";
  }
  return std::nullopt;
}

std::vector<v1::MemoryEstimate> EstimateMemory(const Workload& w, const LayoutChoice& layout,
                                               const ClusterShape& c) {
  const LayoutChoice l = Effective(layout);
  const int64_t accumulation = GradientAccumulation(w, l);
  const int64_t e = ActivationBytes(w);
  const LayerActivations layer = ActivationsPerLayer(w, l);
  const int64_t layers = w.dims.num_layers() / l.pp;
  // Tokens of a sequence on this rank (context parallelism splits it over cp ranks).
  const double s = static_cast<double>(w.seq_len) / l.cp, b = l.micro_batch;
  const double h = w.dims.hidden_size();
  // Ranks holding the same experts: ZeRO shards the routed experts' state over them.
  // ZeRO shards over the dp x cp ranks that hold the same weights (Megatron-Core's distributed
  // optimizer and torchtitan's FSDP do the same); the routed experts over the (dp / ep) x cp that
  // hold the same experts.
  const int shard_ranks = l.dp * l.cp;
  const int expert_dp = std::max(1, l.dp / l.ep) * l.cp;
  const int64_t usable =
      static_cast<int64_t>(static_cast<double>(std::max<int64_t>(
                               0, c.device.memory_bytes() - c.device.reserved_bytes())) *
                           c.memory_headroom);
  std::vector<v1::MemoryEstimate> stages;
  for (int stage = 0; stage < l.pp; ++stage) {
    const StageParameters p = ParametersOfStage(w, l, stage);
    const bool last = stage == l.pp - 1;
    v1::MemoryEstimate mem;
    mem.set_pipeline_stage(stage);
    mem.set_parameters(p.all);
    // The trainer's flat buffers: one per unit, padded to a multiple of dp so that each rank owns
    // an equal 1/dp shard of it. Weights are float32 for what is trained (and for the frozen base
    // in fp32 runs), the compute precision for LoRA's frozen base.
    auto padded = [&](int64_t n) { return CeilDiv(n, shard_ranks) * shard_ranks; };
    const int64_t trainable = p.layers * padded(p.layer_trainable) + padded(p.rest_trainable);
    // The frozen base in the compute precision, less QLoRA's NF4 weights at their own bytes.
    const int64_t layer_frozen_bytes =
        e * (p.layer_frozen - p.layer_nf4_weights) + p.layer_nf4_bytes;
    const int64_t frozen_bytes = e * p.frozen - p.layers * (e * p.layer_nf4_weights -
                                                            p.layer_nf4_bytes);
    const int64_t layer_weights = 4 * p.layer_trainable + layer_frozen_bytes;
    const int64_t rest_weights = 4 * p.rest_trainable + e * p.rest_frozen;
    // ZeRO stage z shards the first z of (optimizer, gradients, weights) over dp: AdamW's exp_avg
    // and exp_avg_sq (8 bytes) for the elements the rank steps from stage 1 (at most its padded
    // shard; ZeRO-0 steps every real element), the float32 gradient buffers from stage 2 (stages
    // 0 and 1 keep full flat buffers that .grad views into), the weights from stage 3. Plus
    // AdamW's float32 step counter per run it steps (StageParameters::step_counters).
    auto shard = [&](int64_t bytes, int from_stage) {
      return l.zero >= from_stage ? CeilDiv(bytes, shard_ranks) : bytes;
    };
    const int64_t weights = shard(4 * trainable, 3) + shard(frozen_bytes, 3);
    const int64_t grads = shard(4 * trainable, 2);
    const int64_t optimizer =
        (l.zero >= 1 ? CeilDiv(8 * trainable, shard_ranks) : 8 * p.trainable) + 4 * p.step_counters;
    const int64_t embedding_state =
        w.lora_rank > 0
            ? shard(e * p.embedding, 3)
            : shard(4 * p.embedding, 3) + shard(4 * p.embedding, 2) + shard(8 * p.embedding, 1);
    // The routed experts: trained in float32 like the rest (or frozen in the compute precision
    // under LoRA), sharded by ZeRO over the dp / ep ranks that hold the same experts.
    auto expert_shard = [&](int64_t bytes, int from_stage) {
      return l.zero >= from_stage ? CeilDiv(bytes, expert_dp) : bytes;
    };
    const bool experts_trained = w.lora_rank == 0;
    const int64_t expert_weights =
        p.layer_expert_nf4_bytes > 0
            ? expert_shard(p.layers * p.layer_expert_nf4_bytes, 3)
            : expert_shard((experts_trained ? 4 : e) * p.experts, 3);
    const int64_t expert_grads = experts_trained ? expert_shard(4 * p.experts, 2) : 0;
    const int64_t expert_optimizer = experts_trained ? expert_shard(8 * p.experts, 1) : 0;
    // Under LoRA the experts' adapters train instead, in float32, sharded alike.
    const int64_t expert_adapters = expert_shard(4 * p.expert_lora, 3) +
                                    expert_shard(4 * p.expert_lora, 2) +
                                    expert_shard(8 * p.expert_lora, 1);
    mem.set_expert_state_bytes(expert_weights + expert_grads + expert_optimizer +
                               expert_adapters);
    mem.set_weights_bytes(weights + expert_weights + expert_shard(4 * p.expert_lora, 3));
    mem.set_gradients_bytes(grads + expert_grads + expert_shard(4 * p.expert_lora, 2));
    mem.set_optimizer_bytes(optimizer + expert_optimizer + expert_shard(8 * p.expert_lora, 1));
    mem.set_embedding_state_bytes(embedding_state);

    // bf16 autocast keeps a copy of every matmul weight it cast in forward until backward; with
    // full recomputation only the layer being recomputed and the head hold theirs at the peak.
    int64_t cast = 0;
    if (e == 2 && p.matmul > 0) {
      const ParameterSplit split = SplitParameters(w, l.tp, l.ep);
      const int64_t per_layer = split.layer_matmul + (experts_trained ? split.layer_expert : 0);
      // ZeRO-3 gathers (and casts) a layer at a time and frees it after use: the layer in use and
      // the one prefetched.
      cast = 2 * (l.ac == v1::ACTIVATION_CHECKPOINTING_FULL || l.zero >= 3
                      ? (l.zero >= 3 ? 2 : 1) * per_layer + (p.matmul - layers * per_layer)
                      : p.matmul);
    }
    mem.set_cast_weights_bytes(cast);

    // Interleaved: chunk micro-batches of layers / v layers each; reported as whole micro-batches
    // (rounded up).
    const int64_t chunks = l.v > 1 ? InFlightChunks(l, accumulation, stage) : 0;
    const int in_flight = l.v > 1 ? static_cast<int>(CeilDiv(chunks, l.v))
                                  : InFlightMicroBatches(l, accumulation, stage);
    mem.set_in_flight_micro_batches(in_flight);
    mem.set_activations_per_layer_bytes(layer.kept);
    int64_t activations =
        l.v > 1 ? chunks * (layers / l.v) * layer.kept : layers * layer.kept * in_flight;
    if (l.ac == v1::ACTIVATION_CHECKPOINTING_FULL) activations += layer.full;  // the recompute
    if (last) {
      // Final norm input (float32) and the head's input in compute precision.
      activations += static_cast<int64_t>(s * b * h * (4 + e) / (l.sp ? l.tp : 1));
      // Without tp the head computes its input's gradient in forward (linear_cross_entropy.h)
      // and holds it, in the input's dtype, until backward.
      if (l.tp == 1) activations += static_cast<int64_t>(s * b * h * e);
    }
    mem.set_activations_bytes(activations);

    // Logits. Without tp the head and its loss run a chunk of tokens at a time
    // (trainer/model/linear_cross_entropy.h). On a GPU the fused kernel writes a chunk's gradient
    // over its logits in place, in the compute precision (e bytes per element, the weight
    // padded to kLossVocabAlignment rows, GpuLossChunkRows rows); the CPU's composite holds
    // the chunk's float32 log-probabilities and the gradient log_softmax's backward takes and
    // gives (12 bytes, LossChunkRows rows). A trained head also holds its weight's gradient
    // from forward to backward, summed over the chunks in float32: on a GPU each chunk's
    // product is summed into it by the product itself, on the CPU one chunk's product in the
    // compute precision exists while it is added. Vocab-parallel over tp the whole shard's logits
    // exist at the start of backward: log-softmax output, the loss gradient and the logits gradient
    // in float32 (12 bytes per element), plus a bf16 copy of that gradient under autocast
    // (ceil(vocab / tp) columns per rank, the padded rows' logits included).
    int64_t logits = 0;
    if (last && l.tp == 1) {
      const bool gpu = !IsCpu(c.device);
      const int64_t vocab = w.dims.vocab_size();
      const int64_t padded = gpu ? LossPaddedVocab(vocab) : vocab;
      const int64_t rows = std::min<int64_t>(
          static_cast<int64_t>(s * b), gpu ? GpuLossChunkRows(vocab, e) : LossChunkRows(vocab));
      logits = rows * padded * (gpu ? e : 12);
      if (w.lora_rank == 0) logits += padded * static_cast<int64_t>(h) * (gpu ? 4 : 4 + e);
    } else if (last) {
      logits = static_cast<int64_t>(s * b * CeilDiv(w.dims.vocab_size(), l.tp) *
                                    (12 + (e == 2 ? 2 : 0)));
    }
    mem.set_logits_bytes(logits);

    // ZeRO 0 and 1 all-reduce / reduce-scatter each unit's flat gradient in place and all-gather
    // the updated shards into the flat weights in place: no copies. ZeRO 2 and 3 keep only the
    // gradient shard, so a unit's full gradient exists while it is computed and reduce-scattered:
    // the non-layer unit's for the whole backward (its head part arrives first, its embedding part
    // last) and up to two layers' (the one in backward and the one being reduce-scattered). ZeRO-3
    // also gathers weights in full: the non-layer unit for the whole forward and backward, and two
    // layers (the one in use and the one prefetched).
    int64_t comm = 0;
    if (shard_ranks > 1 && l.zero >= 2) {
      comm += 4 * (p.rest_trainable + 2 * p.layer_trainable);
      if (l.zero >= 3) comm += rest_weights + 2 * layer_weights;
    }
    if (l.pp > 1) comm += static_cast<int64_t>(4 * s * b * h * e / (l.sp ? l.tp : 1));
    // Expert parallelism: the dispatched tokens' send and receive buffers (top_k copies of each
    // token's hidden state, each way), alive through one all-to-all at a time.
    const int64_t all_to_all =
        IsMoe(w.dims) && l.ep > 1
            ? static_cast<int64_t>(2 * s * b * w.dims.num_experts_per_token() * h * e)
            : 0;
    // Ring attention's backward passes keys and values and their gradients: a send and a receive
    // buffer of each block.
    const int64_t ring = l.cp > 1 ? static_cast<int64_t>(4 * RingBlockBytes(w, l)) : 0;
    mem.set_expert_all_to_all_bytes(all_to_all);
    mem.set_context_ring_bytes(ring);
    comm += all_to_all + ring;
    mem.set_communication_bytes(comm);

    const int64_t overhead = (IsCpu(c.device) ? 0 : c.device.workspace_bytes()) +
                             static_cast<int64_t>(c.device.fragmentation_fraction() *
                                                  static_cast<double>(activations + logits));
    mem.set_overhead_bytes(overhead);

    // The flat gradient buffers (or shards) are allocated once and live through every step, next
    // to the activations.
    mem.set_total_bytes(mem.weights_bytes() + mem.optimizer_bytes() + cast + comm + overhead +
                        mem.gradients_bytes() + activations + logits);
    mem.set_device_capacity_bytes(c.device.memory_bytes());
    mem.set_usable_bytes(usable);
    stages.push_back(std::move(mem));
  }
  return stages;
}

v1::StepTimeEstimate EstimateStepTime(const Workload& w, const LayoutChoice& layout,
                                      const ClusterShape& c) {
  const LayoutChoice l = Effective(layout);
  const v1::ModelDims& m = w.dims;
  const int64_t accumulation = std::max<int64_t>(1, GradientAccumulation(w, l));
  const double tokens = static_cast<double>(w.seq_len) * static_cast<double>(w.global_batch);
  // A mixture of experts computes with its active parameters (top_k experts per token); with
  // balanced routing every expert-parallel rank does the same share.
  const double params = static_cast<double>(CountActiveParameters(w.dims));
  const double attention = AttentionFlopsPerToken(m, w.seq_len);
  // Per token: forward 2N, backward 4N (2N with LoRA: no weight gradients of the frozen base).
  const double model_per_token = (w.lora_rank > 0 ? 4.0 : 6.0) * params + attention;
  double hardware_per_token = model_per_token;
  if (l.ac == v1::ACTIVATION_CHECKPOINTING_FULL) {
    hardware_per_token += 2.0 * params + attention / 3;
  } else if (l.ac == v1::ACTIVATION_CHECKPOINTING_SELECTIVE && !w.flash_attention) {
    hardware_per_token += attention / 3;
  }
  const double peak = PeakFlops(c.device, w.precision);
  const double rate = peak * c.device.achievable_flops_fraction() * GemmEfficiency(w, l);
  // A rank's tokens of one micro-batch: context parallelism splits each sequence over cp ranks
  // (load-balanced causal chunks, so the attention FLOPs split evenly too).
  const double micro_tokens = static_cast<double>(w.seq_len) / l.cp * l.micro_batch;
  // One micro-batch's forward + backward on one device of a stage.
  const double micro_compute = hardware_per_token * micro_tokens / (l.tp * l.pp) / rate;

  // Tensor parallel: two all-reduces of the layer's activations in forward, two in backward (two
  // more in a full recompute); sequence parallelism moves the same bytes as gathers/scatters.
  const int e = ActivationBytes(w);
  const int layers = m.num_layers() / l.pp;
  const double tp_bytes = micro_tokens * m.hidden_size() * e;
  const int tp_collectives = 4 + (l.ac == v1::ACTIVATION_CHECKPOINTING_FULL ? 2 : 0);
  const double micro_tp =
      layers * tp_collectives * AllReduceSeconds(tp_bytes, l.tp, c.device.intra_node_bandwidth());
  const bool full_recompute = l.ac == v1::ACTIVATION_CHECKPOINTING_FULL;

  // Expert parallelism: every MoE layer dispatches its tokens to their experts and combines the
  // results, two all-to-alls forward and two backward (two more in a full recompute), with
  // nothing to overlap them with (the experts wait for their tokens).
  double micro_all_to_all = 0;
  if (const double bytes = AllToAllBytes(w, l); bytes > 0) {
    const double bandwidth = ExpertParallelInsideNode(l, c) ? c.device.intra_node_bandwidth()
                                                            : c.device.inter_node_bandwidth();
    micro_all_to_all =
        layers * (4 + (full_recompute ? 2 : 0)) * (bytes / bandwidth + kCollectiveLatency);
  }

  // Context parallelism: ring attention passes each key/value block cp - 1 hops per layer in
  // forward and twice as much in backward (keys and values again, then their gradients), one
  // more pass in a full recompute. Each hop overlaps with the attention on the block in hand, so
  // only what the attention compute cannot cover is exposed.
  double micro_ring = 0;
  double micro_ring_exposed = 0;
  if (l.cp > 1) {
    const double bandwidth = ContextParallelInsideNode(l, c) ? c.device.intra_node_bandwidth()
                                                             : c.device.inter_node_bandwidth();
    const double passes = 3 + (full_recompute ? 1 : 0);
    micro_ring =
        layers * passes * (l.cp - 1) * (RingBlockBytes(w, l) / bandwidth + kCollectiveLatency);
    const double attention_compute =
        (attention + (full_recompute ? attention / 3 : 0)) * micro_tokens / (l.tp * l.pp) / rate;
    micro_ring_exposed = std::max(0.0, micro_ring - kOverlapEfficiency * attention_compute);
  }
  const double micro_time = micro_compute + micro_tp + micro_all_to_all + micro_ring_exposed;

  // Pipeline: 1F1B runs m micro-batches plus (pp - 1) of fill and drain; each boundary sends
  // activations forward and gradients back. Interleaving v chunks per rank makes the fill and
  // drain v times shorter ((pp - 1) / (v x m) of the step's micro-batch time) and crosses v
  // times as many boundaries.
  double transfer = 0;
  double bubble = 0;
  double bubble_fraction = 0;
  if (l.pp > 1) {
    const double bandwidth = PipelineInsideNode(l, c) ? c.device.intra_node_bandwidth()
                                                      : c.device.inter_node_bandwidth();
    const double p2p = tp_bytes / (l.sp ? l.tp : 1) / bandwidth + kCollectiveLatency;
    transfer = 2.0 * l.v * static_cast<double>(accumulation + l.pp - 1) * p2p;
    bubble_fraction = static_cast<double>(l.pp - 1) / (l.v * static_cast<double>(accumulation));
    bubble = bubble_fraction * micro_time * static_cast<double>(accumulation);
  }

  // Data parallel over the stage's trainable parameters, float32 gradients, reduced over the
  // dp x cp ranks (context-parallel ranks hold the same weights and see different tokens).
  // The routed experts' gradients are reduced over the (dp / ep) x cp ranks holding the same
  // experts, alongside the layers'.
  const StageParameters stage = ParametersOfStage(w, l, 0);
  const int reduce_ranks = l.dp * l.cp;
  const int expert_ranks = std::max(1, l.dp / l.ep) * l.cp;
  // Under LoRA the experts' adapters are what trains of them.
  const double expert_bytes = 4.0 * static_cast<double>(w.lora_rank == 0 ? stage.experts
                                                                          : stage.expert_lora);
  const double grad_bytes = 4.0 * static_cast<double>(stage.trainable);
  const double dp_bandwidth = DataParallelInsideNode(l, c) ? c.device.intra_node_bandwidth()
                                                           : c.device.inter_node_bandwidth();
  double dp_seconds = 0;
  double exposed_dp = 0;
  // Collectives run per unit as backward finishes it (forward uses it, for ZeRO-3's gathers),
  // hidden behind the compute still to come, except for the non-layer unit's: its gradient is
  // complete only when backward reaches the embedding, at the very end, and ZeRO-3 gathers its
  // weights before forward can start. Backward is two thirds of a micro-batch's compute.
  const double rest_bytes = 4.0 * static_cast<double>(stage.rest_trainable);
  const double layer_bytes = grad_bytes - rest_bytes;
  const double micro_backward = micro_compute * 2 / 3;
  if (l.zero == 0) {
    // Each unit's flat gradient all-reduced in place in the last micro-batch's backward.
    const double tail = AllReduceSeconds(rest_bytes, reduce_ranks, dp_bandwidth);
    const double hidden = AllReduceSeconds(layer_bytes, reduce_ranks, dp_bandwidth) +
                          AllReduceSeconds(expert_bytes, expert_ranks, dp_bandwidth);
    dp_seconds = tail + hidden;
    exposed_dp = tail + std::max(0.0, hidden - kOverlapEfficiency * micro_backward);
  } else if (l.zero < 3) {
    // Gradients reduce-scattered: once per step for ZeRO-1 (full gradient buffers accumulate),
    // every micro-batch for ZeRO-2 (only the shard is kept). Then the updated shards are
    // all-gathered into the full weights after the optimizer step, with no compute left to hide
    // behind.
    const double tail = HalfRingSeconds(rest_bytes, reduce_ranks, dp_bandwidth);
    const double hidden = HalfRingSeconds(layer_bytes, reduce_ranks, dp_bandwidth) +
                          HalfRingSeconds(expert_bytes, expert_ranks, dp_bandwidth);
    const double gather = HalfRingSeconds(grad_bytes, reduce_ranks, dp_bandwidth) +
                          HalfRingSeconds(expert_bytes, expert_ranks, dp_bandwidth);
    const double scatters = l.zero == 1 ? 1.0 : static_cast<double>(accumulation);
    dp_seconds = scatters * (tail + hidden) + gather;
    exposed_dp =
        scatters * (tail + std::max(0.0, hidden - kOverlapEfficiency * micro_backward)) + gather;
  } else {
    // Every micro-batch: the non-layer unit gathered once (before forward) and reduce-scattered
    // once (after backward), exposed; each layer gathered for forward and again for backward and
    // reduce-scattered, prefetched behind all of the step's compute.
    const double tail = 2 * HalfRingSeconds(rest_bytes, reduce_ranks, dp_bandwidth);
    const double hidden = 3 * (HalfRingSeconds(layer_bytes, reduce_ranks, dp_bandwidth) +
                               HalfRingSeconds(expert_bytes, expert_ranks, dp_bandwidth));
    const double micro_batches = static_cast<double>(accumulation);
    dp_seconds = micro_batches * (tail + hidden);
    exposed_dp =
        micro_batches * (tail + std::max(0.0, hidden - kOverlapEfficiency * micro_compute));
  }

  // AdamW reads weight, gradient and both moments and writes three of them back (28 bytes per
  // parameter it owns), plus the gradient-norm pass over the gradients the rank holds (4 bytes).
  const double experts =
      static_cast<double>(w.lora_rank == 0 ? stage.experts : stage.expert_lora);
  const double trainable = static_cast<double>(stage.trainable) + experts;
  const double owned = static_cast<double>(stage.trainable) / (l.zero >= 1 ? reduce_ranks : 1) +
                       experts / (l.zero >= 1 ? expert_ranks : 1);
  const double optimizer =
      (28.0 * owned + 4.0 * (l.zero >= 2 ? owned : trainable)) / c.device.memory_bandwidth();

  v1::StepTimeEstimate est;
  est.set_compute_seconds(micro_compute * static_cast<double>(accumulation));
  est.set_tensor_parallel_seconds(micro_tp * static_cast<double>(accumulation));
  est.set_pipeline_bubble_seconds(bubble);
  est.set_pipeline_bubble_fraction(bubble_fraction);
  est.set_expert_all_to_all_seconds(micro_all_to_all * static_cast<double>(accumulation));
  est.set_context_ring_seconds(micro_ring * static_cast<double>(accumulation));
  est.set_pipeline_transfer_seconds(transfer);
  est.set_data_parallel_seconds(dp_seconds);
  est.set_optimizer_seconds(optimizer);
  est.set_exposed_communication_seconds(
      est.tensor_parallel_seconds() + est.expert_all_to_all_seconds() +
      micro_ring_exposed * static_cast<double>(accumulation) + transfer + exposed_dp);
  const double step =
      micro_time * static_cast<double>(accumulation) + bubble + transfer + exposed_dp + optimizer;
  est.set_step_seconds(step);
  est.set_tokens_per_second(tokens / step);
  est.set_model_flops(model_per_token * tokens);
  est.set_hardware_flops(hardware_per_token * tokens);
  est.set_mfu(peak > 0 ? model_per_token * tokens / (step * l.world() * peak) : 0);
  return est;
}

}  // namespace tessera::planner
