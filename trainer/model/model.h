// The decoder-only transformer a trainer rank trains: GPT-2 (LayerNorm, GELU, learned positions,
// biases) or Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, optional Qwen3 qk_norm) as
// picked by ModelDims.architecture. Parameters are float32; the caller applies bf16 autocast, and
// the numerically sensitive parts (norms, rotary, loss) compute in float32 regardless. Built from
// dimensions that planner::ResolveModel has validated and filled in; errors surface as c10::Error.
// With dims.num_experts > 0 every block's MLP is a mixture of experts (moe.h) and the training
// loss adds the routers' load-balancing loss.
// Activation checkpointing (v1::ActivationCheckpointing) trades recompute for activation memory,
// and LayerHooks let a sharded engine (ZeRO-3) act around each transformer layer.
#pragma once

#include <torch/nn.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/layout.pb.h"
#include "tessera/v1/model.pb.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/lora.h"
#include "trainer/model/moe.h"
#include "trainer/model/nf4.h"
#include "trainer/parallel/ring_attention.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tessera::trainer {

// Rotary cos and sin tables for positions [0, max_seq_len), each float32 [max_seq_len, head_dim],
// in the rotate-half layout (frequency i at columns i and i + head_dim / 2). Computed in double so
// long contexts keep precise angles.
std::pair<torch::Tensor, torch::Tensor> RotaryTables(int64_t max_seq_len, int64_t head_dim,
                                                     double theta);

// Rotates x [..., seq, head_dim] by the tables' rows [seq, head_dim] for its positions, in float32,
// and returns x's dtype (one fused kernel on a GPU: trainer/kernels/fused_ops.h).
torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin);

// x * rsqrt(mean(x^2) + eps) * weight over the last dimension, in float32; returns x's dtype (one
// fused kernel on a GPU: trainer/kernels/fused_ops.h).
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// The whole value of this rank's parameter `name` (its tensor-parallel shard, shaped like the
// parameter), float32 on any device: CausalLMImpl::InitialValue, or weights read from a file.
using ParameterValues = std::function<absl::StatusOr<torch::Tensor>(const std::string& name)>;

// How a CausalLM's parameters are created.
enum class ParameterStorage {
  // float32 on the CPU, initialised (CausalLMImpl::InitialValue).
  kInitialized,
  // On the meta device: shapes only, no memory and no values. For ZeRO-3, whose ShardedEngine
  // allocates each unit on the training device and fills only the rank's shard (from
  // InitialValue, Hugging Face weights or a checkpoint), so that no rank ever holds the whole
  // model. Nothing may run on the model before that.
  kDeferred,
};

// A linear layer's parameters under torch::nn::Linear's names: "weight" [out, in] and, with a
// bias, "bias" [out], created without values (CausalLM initialises every parameter itself, so
// the default initialisation torch::nn::Linear draws would be thrown away) with `options`.
class DenseImpl : public torch::nn::Module {
 public:
  DenseImpl(int64_t in, int64_t out, bool bias, const torch::TensorOptions& options);
  // x W^T + b: through at::linear, or for an NF4 weight dequantized on the fly (qlora.cc).
  torch::Tensor Forward(const torch::Tensor& x);
  // QLoRA (qlora.h): stores `value` [out, in] as the frozen weight in NF4 in place of the
  // "weight" parameter, as the frozen parameters "weight_nf4_codes", "weight_nf4_absmax_codes"
  // (uint8), "weight_nf4_absmax_scales" and "weight_nf4_absmax_offset" (float32), so device
  // moves carry them and the engine counts them as frozen bytes; `weight` keeps only the shape
  // (a meta tensor). Defined in qlora.cc.
  void QuantizeWeightNf4(const torch::Tensor& value);
  bool is_nf4() const { return nf4_.has_value(); }
  // The NF4 weight (tensors shared with the module's parameters); set when is_nf4().
  const std::optional<Nf4Tensor>& nf4_weight() const { return nf4_; }
  torch::Tensor weight;
  torch::Tensor bias;  // undefined without one

 private:
  // Forward for an NF4 weight, in autocast's dtype where autocast is on (qlora.cc).
  torch::Tensor Nf4Forward(const torch::Tensor& x);
  std::optional<Nf4Tensor> nf4_;
};
TORCH_MODULE(Dense);

// An embedding table "weight" [rows, dim], created like DenseImpl's parameters; forward(ids)
// looks rows up as torch::nn::Embedding does.
class EmbeddingTableImpl : public torch::nn::Module {
 public:
  EmbeddingTableImpl(int64_t rows, int64_t dim, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor weight;
};
TORCH_MODULE(EmbeddingTable);

// LayerNorm (GPT2, with bias) or RMSNorm (LLAMA, no bias) over the last dimension. With
// autocast_output, a float32 input on a device where autocast is on is normalised straight into
// autocast's dtype: the linear layers that take the output would cast it there anyway, and
// the fused kernel writes the 16-bit result (and reads its 16-bit gradient) in one pass instead
// of writing float32 for a cast kernel to read. Same values as the cast; the model sets it for
// the norms that feed linear layers, except under tensor parallelism (whose all-reduce of the
// input gradient then stays in float32).
class NormImpl : public torch::nn::Module {
 public:
  NormImpl(int64_t size, double eps, bool rms, bool autocast_output = false,
           const torch::TensorOptions& options = torch::kFloat32);
  torch::Tensor forward(const torch::Tensor& x);
  // forward(x) and x for the residual connection around the layer the output feeds
  // (FusedRmsNormKeepingInput).
  NormAndInput ForwardKeepingInput(const torch::Tensor& x);

 private:
  // The output's dtype: autocast's for a float32 x under autocast_output, else x's (nullopt).
  std::optional<at::ScalarType> OutputDtype(const torch::Tensor& x) const;

  double eps_;
  bool rms_;
  bool autocast_output_;
  torch::Tensor weight_;
  torch::Tensor bias_;  // undefined for RMSNorm
};
TORCH_MODULE(Norm);

// Causal self-attention of one block: fused qkv for GPT2, separate q/k/v with RoPE and
// grouped-query attention for LLAMA. Under tensor parallelism it holds heads / tp query heads and
// kv_heads / tp key/value heads (column-parallel projections, row-parallel output).
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const v1::ModelDims& dims, const TensorParallel& tp,
                const torch::TensorOptions& options);
  // x [batch, seq, hidden]; cos/sin [seq, head_dim], or [batch, 1, seq, head_dim] for packed
  // records (undefined for GPT2); mask: undefined for plain causal attention, else which keys
  // each query sees, bool [batch, 1, seq, seq] (SequenceLayout).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  // Recompute scaled_dot_product_attention in backward, keeping only q, k and v for it.
  void set_recompute_core(bool recompute) { recompute_core_ = recompute; }
  // Adapters on the projections `options.targets` names ("attn.q", ...), split over tp as the
  // projections are (lora.h).
  void AddLora(const LoraOptions& options);
  // With cp enabled, x holds a cp rank's part of each sequence (ShardForContextParallel) and the
  // core is RingAttention over cp's group; plain causal masks only (no packed records).
  void set_context_parallel(const ContextParallel& cp) { cp_ = cp; }

 private:
  torch::Tensor Core(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& mask) const;

  bool llama_;
  bool recompute_core_ = false;
  TensorParallel tp_;
  ContextParallel cp_;
  int64_t heads_, kv_heads_, head_dim_;  // this rank's heads
  Dense qkv_{nullptr}, q_{nullptr}, k_{nullptr}, v_{nullptr}, out_{nullptr};
  LoraAdapter qkv_lora_, q_lora_, k_lora_, v_lora_, out_lora_;
  Norm q_norm_{nullptr}, k_norm_{nullptr};
};
TORCH_MODULE(Attention);

// GELU MLP (GPT2) or SwiGLU (LLAMA); ffn_hidden_size / tp columns of it under tensor parallelism.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const v1::ModelDims& dims, const TensorParallel& tp, const torch::TensorOptions& options);
  torch::Tensor forward(const torch::Tensor& x);
  // Recompute the activation function's outputs (GELU's; SwiGLU's silu(gate) and
  // silu(gate) * up) in backward, keeping only their inputs.
  void set_recompute_activation(bool recompute) { recompute_activation_ = recompute; }
  // Adapters on the projections `options.targets` names ("mlp.up", ...), split over tp as the
  // projections are (lora.h).
  void AddLora(const LoraOptions& options);

 private:
  bool llama_;
  bool recompute_activation_ = false;
  TensorParallel tp_;
  Dense up_{nullptr}, gate_{nullptr}, down_{nullptr};
  LoraAdapter up_lora_, gate_lora_, down_lora_;
};
TORCH_MODULE(Mlp);

// The MoE layer of resolved `dims` (num_experts > 0), parameters drawn with `init_std`.
MoeOptions MoeOptionsOf(const v1::ModelDims& dims, double init_std);

// What an MoE block's router decided in its last forward call (both undefined for a dense block).
struct RouterStats {
  // Token slots routed to each expert, int64 [num_experts] (MoeOutput::tokens_per_expert).
  torch::Tensor tokens_per_expert;
  // Mean router probability of each expert, differentiable, [num_experts].
  torch::Tensor router_prob_mean;
};

// Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)); the MLP is an MoE layer
// when dims.num_experts > 0 (registered as "mlp" too, so its parameters read
// "layers.N.mlp.router.weight", "layers.N.mlp.experts.gate", ...).
class BlockImpl : public torch::nn::Module {
 public:
  // `options`: the parameters' (float32, on the CPU or the meta device).
  BlockImpl(const v1::ModelDims& dims, const TensorParallel& tp,
            const torch::TensorOptions& options, const ExpertParallel& ep = {});
  // As AttentionImpl::forward.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {});
  Attention& attention() { return attn_; }
  Mlp& mlp() { return mlp_; }  // null for an MoE block
  bool is_moe() const { return !moe_.is_empty(); }
  // The MoE layer's routing in the last forward call (not thread-safe, as the module).
  const RouterStats& last_router() const { return last_router_; }
  // SELECTIVE recomputation inside the block; NONE and FULL (done by the caller) keep everything.
  void SetActivationCheckpointing(v1::ActivationCheckpointing mode);
  // On an MoE block the "mlp." targets adapt every expert (moe_lora.h; c10::Error for the
  // router or shared experts).
  void AddLora(const LoraOptions& options);

 private:
  Norm attn_norm_{nullptr}, mlp_norm_{nullptr};
  Attention attn_{nullptr};
  Mlp mlp_{nullptr};
  MoeLayer moe_{nullptr};
  RouterStats last_router_;
};
TORCH_MODULE(Block);

// Called around each transformer layer's forward (ZeRO-3 gathers a layer's parameters before it
// and frees them after). Runs on the thread calling forward, once per layer and forward call in
// layer order; never during backward, also not when FULL checkpointing recomputes a layer there.
// With FULL, layer i's recompute is the first thing backward does after the gradient of its output
// arrives, so autograd hooks registered in AfterLayer run before it (the place to gather the
// layer's parameters again). SELECTIVE's recomputes use no parameters.
class LayerHooks {
 public:
  virtual ~LayerHooks() = default;
  virtual void BeforeLayer(int layer) = 0;
  // Returns the layer's output (may register autograd hooks on it).
  virtual torch::Tensor AfterLayer(int layer, torch::Tensor output) = 0;
};

// Which part of the model a rank holds: its tensor-parallel split and, under pipeline
// parallelism, its stage's layers. Parameter names stay those of the whole model
// ("layers.<global index>.", "embed.weight"), so checkpoints do not depend on the layout.
struct ModelPartition {
  TensorParallel tp;
  // Mixture-of-experts models: this rank holds its ep shard of each layer's routed experts
  // (moe.h); their ShardOf global shape is the logical [num_experts, ...].
  ExpertParallel ep;
  int first_layer = 0;
  int num_layers = -1;  // per chunk; -1: every layer from first_layer on (one chunk)
  // Interleaved pipeline stages hold `chunks` blocks of num_layers consecutive layers, chunk j
  // from first_layer + j * chunk_stride; StageForward runs one chunk at a time.
  int chunks = 1;
  int chunk_stride = 0;
  // The first stage holds the embeddings; the last the final norm, the LM head and the loss.
  // With tied embeddings the last stage of a pipeline holds its own copy of embed.weight as the
  // head (the engine keeps the two copies' gradients summed).
  bool embedding = true;
  bool head = true;
  // Context parallelism: every stage's input holds this cp rank's two chunks of each sequence
  // (ring_attention.h); positions and attention are the whole sequence's. Disabled by default.
  ContextParallel cp;
};

// A decoder-only transformer (GPT2 or LLAMA family per dims.architecture), in float32 parameters.
class CausalLMImpl : public torch::nn::Module {
 public:
  // dims must be resolved (planner::ResolveModel output); init_std 0 means
  // planner::kDefaultInitStd. Initialisation is deterministic given torch::manual_seed: one number
  // is drawn from LibTorch's CPU generator, and every parameter is drawn in full from a generator
  // seeded by it and the parameter's name, then cut to this rank's shard. So a parameter's
  // initial value is the same under every layout. kDeferred storage: see ParameterStorage.
  CausalLMImpl(const v1::ModelDims& dims, double init_std, const ModelPartition& partition = {},
               ParameterStorage storage = ParameterStorage::kInitialized);
  // tokens: int64 [batch, seq] (seq <= max_seq_len) -> logits float [batch, seq, vocab]. The whole
  // model on one rank only.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions = {});
  // Mean next-token cross-entropy over the counted positions: logits of inputs vs targets, both
  // int64 [batch, seq]. Computed in float32. Targets of kIgnoreTarget (-100, data_loader.h) are
  // not counted; with none counted the loss is 0 with zero gradients (never NaN). The whole
  // model (any tp). A caller weighing micro-batches multiplies by the counted targets.
  // `positions` as StageForward.
  torch::Tensor Loss(const torch::Tensor& inputs, const torch::Tensor& targets,
                     const torch::Tensor& positions = {});
  // This rank's stage of the forward: tokens in on the first stage, else the previous stage's
  // activations [batch, seq (/ tp with sequence parallelism), hidden]; out the loss on the last
  // stage (targets are only read there), else the activations for the next stage.
  // `positions`: undefined when every sample is one record; for samples packed with several
  // records (MicroBatch::positions), each token's position in its record, int64 [batch, seq]
  // (the whole sequence, also under sequence parallelism) on every stage. Records are then kept
  // apart: a token attends only to earlier tokens of its own record, and position embeddings /
  // rotary angles count from the record's start, so that a record's logits are those it gets
  // alone in a sample.
  // `chunk`: which of the partition's chunks runs; the embeddings go with the first, the head
  // and the loss with the last.
  torch::Tensor StageForward(const torch::Tensor& input, const torch::Tensor& targets,
                             const torch::Tensor& positions = {}, int chunk = 0);
  // Mixture-of-experts models: the routers' load-balancing loss of the last forward call on this
  // rank's layers, detached. Each layer's loss is transformers' load_balancing_loss_func on that
  // layer's routing alone, num_experts * sum_e f_e P_e (f_e the share of the layer's tokens
  // routed to expert e, P_e its mean router probability); the model's loss is their mean over
  // the model's num_layers, as Megatron-Core averages per-layer losses (transformers instead
  // pools every layer's routing before taking f and P, which no pipeline stage could compute on
  // its own layers). A stage's value is its layers' sum / num_layers, so the stages' values add
  // up to the model's (SumRouterAuxLossOver). In training mode (is_training()) the loss
  // StageForward and Loss return adds router_aux_loss_coef times it (differentiable through P);
  // a stage that is not the last joins its term to the backward through its output
  // (AttachAuxLoss, scaled by set_aux_loss_scale). Undefined for a dense model or before a
  // forward.
  torch::Tensor last_router_aux_loss() const { return last_router_aux_loss_; }
  // The loss weight of the micro-batch whose stage backward runs next (AuxLossScale); the engine
  // sets it before each backward of a pipeline stage.
  void set_aux_loss_scale(double scale) { aux_loss_scale_->value = scale; }
  // For the report after a pipelined step (every stage calls it after the same forward calls,
  // each chunk's last one being the step's last micro-batch): sets last_router_aux_loss to the
  // whole model's router loss of that micro-batch, the sum over every chunk of this stage and
  // over the stages of `pipeline`, and last_tokens_per_expert to every MoE layer's counts of it,
  // int64 [the model's MoE layers, num_experts] in layer order. So an interleaved stage reports
  // all of its chunks, not the one that ran last. Collectives over `pipeline`.
  void SumRouterAuxLossOver(c10d::ProcessGroup& pipeline);
  // Token slots routed to each expert by each of this rank's layers in the last forward call,
  // int64 [layers of that call, num_experts]; undefined for a dense model. After
  // SumRouterAuxLossOver, the whole model's (see there).
  torch::Tensor last_tokens_per_expert() const { return last_tokens_per_expert_; }

  // Parameters that get weight decay (matrices and embeddings, dim >= 2) and those that do not
  // (biases, norm weights).
  std::vector<torch::Tensor> DecayParameters();
  std::vector<torch::Tensor> NoDecayParameters();
  const v1::ModelDims& dims() const { return dims_; }
  const ModelPartition& partition() const { return partition_; }

  // What forward keeps for backward: UNSPECIFIED and NONE keep everything; SELECTIVE recomputes
  // each layer's attention core and MLP activation function (planner::ActivationsPerLayer's
  // model); FULL keeps only each layer's input and recomputes the layer. Losses and gradients are
  // unchanged (bitwise on CPU). Set between steps, not during one.
  void SetActivationCheckpointing(v1::ActivationCheckpointing mode);
  v1::ActivationCheckpointing activation_checkpointing() const { return checkpointing_; }
  // nullptr = none; not owned, must outlive the forward calls that use it. Hooks get the layer's
  // local index (0 is this rank's first layer).
  void SetLayerHooks(LayerHooks* hooks) { hooks_ = hooks; }

  // This rank's transformer blocks, in order (chunk by chunk).
  int num_local_layers() const { return static_cast<int>(blocks_.size()); }
  // The local index (0 .. num_local_layers() - 1) of global layer `layer`; -1 when not held.
  int LocalLayerIndex(int layer) const;
  // named_parameters() entries, in its order, whose name starts with "layers.<layer>." (a global
  // index of a layer this rank holds); for layer -1 all the others (embeddings, final norm,
  // lm_head). Names are full ("layers.3.attn.qkv.weight", "embed.weight"). c10::Error for a
  // layer this rank does not hold.
  std::vector<std::pair<std::string, torch::Tensor>> LayerParameters(int layer);
  // How a parameter of this rank is split over tp (its global shape included).
  const ParamShard& ShardOf(const std::string& name) const;
  // The initial value of this rank's parameter `name` (its shard of the whole tensor), float32
  // on the CPU: what a kInitialized model starts from, and what a ZeRO-3 engine fills a
  // kDeferred model's shards from. c10::Error for a name this rank does not hold.
  torch::Tensor InitialValue(const std::string& name) const;
  ParameterStorage storage() const { return storage_; }
  // A kDeferred model whose every parameter the caller has since given memory and values on the
  // CPU (QLoRA's MaterializeNf4Base) is kInitialized from then on.
  void SetMaterialized();
  // Moves the model to `device`: the whole module when kInitialized; only the buffers when
  // kDeferred (its parameters get their memory on the device from the ZeRO-3 engine).
  void MoveTo(torch::Device device);
  // Every parameter name of the whole model, whatever this rank holds.
  std::vector<std::string> AllParameterNames() const;
  // Those of AllParameterNames() that train: all of them, or the adapters' with LoRA.
  std::vector<std::string> TrainableParameterNames() const;

  // LoRA: freezes every parameter (requires_grad false) and adds an adapter to each linear layer
  // of every block that `options.targets` names. A is drawn uniform in +-1/sqrt(in) (PyTorch's
  // default for a linear layer, as PEFT initialises it) from a generator seeded like the other
  // parameters' (the same under every layout), B is zero. Call once, after loading weights and
  // before moving the model to its device. Needs rank > 0 and kInitialized storage. Under tensor
  // parallelism each adapter is split as lora.h says (ShardOf gives its split and whole shape).
  void AddLora(const LoraOptions& options);
  // The options AddLora was given; rank 0 when it was not called.
  const LoraOptions& lora() const { return lora_; }

 private:
  torch::Tensor Embed(const torch::Tensor& tokens, const torch::Tensor& positions);
  // The global positions (int64, on the model's device) of a cp rank's `local_seq` tokens.
  torch::Tensor ContextPositions(int64_t local_seq) const;
  // Runs the local blocks [begin, end) (all of them when end is -1).
  torch::Tensor RunLayers(torch::Tensor h, const torch::Tensor& positions, int begin = 0,
                          int end = -1);
  torch::Tensor HeadLoss(const torch::Tensor& h, const torch::Tensor& targets);
  // The load-balancing loss of the routing RunLayers collected (differentiable); sets the
  // last_router_* members.
  torch::Tensor RouterAuxLoss();

  v1::ModelDims dims_;
  ModelPartition partition_;
  EmbeddingTable embed_{nullptr};
  EmbeddingTable pos_embed_{nullptr};      // GPT2 only
  torch::nn::ModuleDict layers_{nullptr};  // keyed by global layer index
  std::vector<std::shared_ptr<BlockImpl>> blocks_;
  Norm final_norm_{nullptr};
  torch::Tensor lm_head_;              // undefined when tied: the output reuses embed_'s weight
  torch::Tensor rope_cos_, rope_sin_;  // LLAMA only; buffers, so they follow .to(device)
  std::map<std::string, ParamShard> shards_;
  ParameterStorage storage_;
  double init_std_;
  uint64_t init_seed_ = 0;
  LoraOptions lora_;
  v1::ActivationCheckpointing checkpointing_ = v1::ACTIVATION_CHECKPOINTING_NONE;
  LayerHooks* hooks_ = nullptr;
  std::vector<RouterStats> router_stats_;  // RunLayers' last call, one per MoE layer
  torch::Tensor last_router_aux_loss_, last_tokens_per_expert_;
  // Per chunk, StageForward's last call's router loss and counts (undefined for a chunk without
  // an MoE layer or not run yet), and the global index of each of the chunk's MoE layers.
  struct ChunkRouting {
    torch::Tensor aux_loss, tokens_per_expert;
    std::vector<int> moe_layers;
  };
  std::vector<ChunkRouting> chunk_routing_;
  // Heap-held so that the address AttachAuxLoss nodes keep survives moves of the module.
  std::unique_ptr<AuxLossScale> aux_loss_scale_ = std::make_unique<AuxLossScale>();
};
TORCH_MODULE(CausalLM);

}  // namespace tessera::trainer
