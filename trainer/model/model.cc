#include "trainer/model/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "planner/model_config.h"
#include "trainer/model/activation_checkpoint.h"
#include "trainer/data/data_loader.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/linear_cross_entropy.h"
#include "trainer/model/qlora.h"
#include "trainer/parallel/peer_wait.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

bool IsLlama(const v1::ModelDims& dims) { return dims.architecture() == v1::ARCHITECTURE_LLAMA; }

// 64-bit FNV-1a: a hash of a parameter's name that is the same in every process and build.
uint64_t NameHash(const std::string& name) {
  uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : name) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

// Column-parallel output (`tp` splits `out`), or the whole linear.
Dense ColumnLinear(int64_t in, int64_t out, bool bias, const TensorParallel& tp,
                   const torch::TensorOptions& options) {
  return Dense(in, out / tp.size, bias, options);
}

// Row-parallel input (`tp` splits `in`; the bias stays whole).
Dense RowLinear(int64_t in, int64_t out, bool bias, const TensorParallel& tp,
                const torch::TensorOptions& options) {
  return Dense(in / tp.size, out, bias, options);
}

// x W^T + b through at::linear, as Python's nn.Linear runs it: for activations of more than two
// dimensions one matrix product with the bias added in its epilogue, where LibTorch's C++
// Linear::forward (F::linear) runs the product and then a separate in-place add, one more pass
// over the output forward and a separate node backward.
torch::Tensor LinearForward(Dense& linear, const torch::Tensor& x) {
  return linear->Forward(x);
}

// A row-parallel linear's output: the partial products summed over tp (or reduce-scattered along
// the sequence), then the bias. Without tp exactly the plain linear.
torch::Tensor RowParallelForward(Dense& linear, const torch::Tensor& x, const TensorParallel& tp) {
  if (!tp.enabled()) return LinearForward(linear, x);
  torch::Tensor y = ExitTensorParallel(
      linear->is_nf4() ? Nf4ProductWithoutBias(*linear, x) : F::linear(x, linear->weight), tp);
  return linear->bias.defined() ? y + linear->bias : y;
}

// Registers `linear`'s adapter when `options.targets` names it ("<module>.<child>").
void AttachLora(const std::string& module, const char* child, Dense& linear,
                const LoraOptions& options, LinearSplit split, const TensorParallel& tp,
                LoraAdapter* adapter) {
  if (!linear || !options.targets.contains(absl::StrCat(module, ".", child))) return;
  *adapter = AttachLoraAdapter(*linear, linear->weight, options, split, tp);
}

torch::Tensor Project(Dense& linear, const LoraAdapter& lora, const torch::Tensor& x) {
  return AddLoraDelta(LinearForward(linear, x), lora, x, linear->is_training());
}

// Which keys each query sees when samples hold several records: bool [batch, 1, seq, seq] from
// each token's position in its record, int64 [batch, seq].
torch::Tensor RecordMask(const torch::Tensor& positions) {
  const int64_t seq = positions.size(1);
  const torch::Tensor index = torch::arange(seq, positions.options());
  // Query i sees keys j with start(i) <= j <= i, start(i) = i - positions[i].
  const torch::Tensor start = index.unsqueeze(0) - positions;  // [batch, seq]
  const torch::Tensor keys = index.view({1, 1, seq});
  return keys.le(index.view({1, seq, 1})).logical_and(keys.ge(start.unsqueeze(-1))).unsqueeze(1);
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> RotaryTables(int64_t max_seq_len, int64_t head_dim,
                                                     double theta) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "rotary head_dim must be even, got ", head_dim);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  torch::Tensor inv_freq =
      torch::pow(theta, -torch::arange(0, head_dim, 2, f64) / static_cast<double>(head_dim));
  torch::Tensor angles = torch::outer(torch::arange(max_seq_len, f64), inv_freq);
  angles = torch::cat({angles, angles}, -1);
  return {angles.cos().to(torch::kFloat32), angles.sin().to(torch::kFloat32)};
}

torch::Tensor ApplyRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) {
  return FusedRotary(x, cos, sin);
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return FusedRmsNorm(x, weight, eps);
}

DenseImpl::DenseImpl(int64_t in, int64_t out, bool with_bias, const torch::TensorOptions& options) {
  weight = register_parameter("weight", torch::empty({out, in}, options));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}, options));
}

torch::Tensor DenseImpl::Forward(const torch::Tensor& x) {
  if (is_nf4()) return Nf4Forward(x);
  return at::linear(x, weight, bias);
}

EmbeddingTableImpl::EmbeddingTableImpl(int64_t rows, int64_t dim,
                                       const torch::TensorOptions& options) {
  weight = register_parameter("weight", torch::empty({rows, dim}, options));
}

torch::Tensor EmbeddingTableImpl::forward(const torch::Tensor& ids) {
  return at::embedding(weight, ids);
}

NormImpl::NormImpl(int64_t size, double eps, bool rms, bool autocast_output,
                   const torch::TensorOptions& options)
    : eps_(eps), rms_(rms), autocast_output_(autocast_output) {
  // Ones and zeros: its initial value (on the meta device just the shapes).
  weight_ = register_parameter("weight", torch::ones({size}, options));
  if (!rms_) bias_ = register_parameter("bias", torch::zeros({size}, options));
}

std::optional<at::ScalarType> NormImpl::OutputDtype(const torch::Tensor& x) const {
  const at::DeviceType device = x.device().type();
  if (autocast_output_ && x.scalar_type() == at::kFloat &&
      (device == at::kCUDA || device == at::kCPU) && at::autocast::is_autocast_enabled(device)) {
    return at::autocast::get_autocast_dtype(device);
  }
  return std::nullopt;
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (rms_) return FusedRmsNorm(x, weight_, eps_, OutputDtype(x));
  return FusedLayerNorm(x, weight_, bias_, eps_, OutputDtype(x));
}

NormAndInput NormImpl::ForwardKeepingInput(const torch::Tensor& x) {
  if (rms_) return FusedRmsNormKeepingInput(x, weight_, eps_, OutputDtype(x));
  return FusedLayerNormKeepingInput(x, weight_, bias_, eps_, OutputDtype(x));
}

AttentionImpl::AttentionImpl(const v1::ModelDims& dims, const TensorParallel& tp,
                             const torch::TensorOptions& options)
    : llama_(IsLlama(dims)),
      tp_(tp),
      heads_(dims.num_attention_heads() / tp.size),
      kv_heads_(dims.num_kv_heads() / tp.size),
      head_dim_(dims.head_dim()) {
  TORCH_CHECK(dims.num_attention_heads() % tp.size == 0 && dims.num_kv_heads() % tp.size == 0,
              "tensor_parallel ", tp.size, " must divide the ", dims.num_attention_heads(),
              " attention heads and the ", dims.num_kv_heads(), " key/value heads");
  const int64_t d = dims.hidden_size();
  const int64_t q_width = dims.num_attention_heads() * head_dim_,
                kv_width = dims.num_kv_heads() * head_dim_;
  if (llama_) {
    q_ = register_module("q", ColumnLinear(d, q_width, false, tp, options));
    k_ = register_module("k", ColumnLinear(d, kv_width, false, tp, options));
    v_ = register_module("v", ColumnLinear(d, kv_width, false, tp, options));
    out_ = register_module("o", RowLinear(q_width, d, false, tp, options));
    if (dims.qk_norm()) {
      // One weight of size head_dim shared by all heads, as in Qwen3.
      q_norm_ = register_module("q_norm", Norm(head_dim_, dims.norm_eps(), /*rms=*/true,
                                               /*autocast_output=*/false, options));
      k_norm_ = register_module("k_norm", Norm(head_dim_, dims.norm_eps(), /*rms=*/true,
                                               /*autocast_output=*/false, options));
    }
  } else {
    qkv_ = register_module("qkv", ColumnLinear(d, 3 * q_width, true, tp, options));
    out_ = register_module("proj", RowLinear(q_width, d, true, tp, options));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& input, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& mask) {
  const torch::Tensor x = EnterTensorParallel(input, tp_);
  const int64_t batch = x.size(0), seq = x.size(1);
  torch::Tensor q, k, v;
  if (llama_) {
    q = Project(q_, q_lora_, x).view({batch, seq, heads_, head_dim_});
    k = Project(k_, k_lora_, x).view({batch, seq, kv_heads_, head_dim_});
    v = Project(v_, v_lora_, x).view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2);
    if (q_norm_) {
      q = q_norm_->forward(q);
      k = k_norm_->forward(k);
    }
    q = ApplyRotary(q.transpose(1, 2), cos, sin);
    k = ApplyRotary(k.transpose(1, 2), cos, sin);
  } else {
    // [batch, seq, 3, heads, head_dim] -> three [batch, heads, seq, head_dim] views, whose
    // backward writes the projection's gradient in one pass (not three selects, each of which
    // would write a zero-filled gradient of the whole projection for autograd to add).
    const std::vector<torch::Tensor> qkv = SplitQkv(Project(qkv_, qkv_lora_, x), heads_, head_dim_);
    q = qkv[0];
    k = qkv[1];
    v = qkv[2];
  }
  torch::Tensor out =
      recompute_core_
          ? Checkpoint(
                [this, mask](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
                  return {Core(in[0], in[1], in[2], mask)};
                },
                {q, k, v})[0]
          : Core(q, k, v, mask);
  const torch::Tensor merged = out.transpose(1, 2).reshape({batch, seq, heads_ * head_dim_});
  return AddLoraDelta(RowParallelForward(out_, merged, tp_), out_lora_, merged, is_training());
}

void AttentionImpl::AddLora(const LoraOptions& options) {
  using enum LinearSplit;
  AttachLora("attn", "qkv", qkv_, options, kColumn, tp_, &qkv_lora_);
  AttachLora("attn", "q", q_, options, kColumn, tp_, &q_lora_);
  AttachLora("attn", "k", k_, options, kColumn, tp_, &k_lora_);
  AttachLora("attn", "v", v_, options, kColumn, tp_, &v_lora_);
  AttachLora("attn", llama_ ? "o" : "proj", out_, options, kRow, tp_, &out_lora_);
}

torch::Tensor AttentionImpl::Core(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& mask) const {
  if (cp_.enabled()) {
    // The keys of the whole sequence are spread over the cp ranks: the ring brings them here.
    TORCH_CHECK(!mask.defined(), "context parallelism runs plain causal attention only");
    return RingAttention(q, k, v, cp_);
  }
  // enable_gqa lets the kernel share each kv head across its query group instead of
  // materialising repeated k and v. A mask (packed records) already holds causality.
  return at::scaled_dot_product_attention(q, k, v,
                                          mask.defined() ? std::optional(mask) : std::nullopt,
                                          /*dropout_p=*/0.0,
                                          /*is_causal=*/!mask.defined(), /*scale=*/std::nullopt,
                                          /*enable_gqa=*/kv_heads_ != heads_);
}

MlpImpl::MlpImpl(const v1::ModelDims& dims, const TensorParallel& tp,
                 const torch::TensorOptions& options)
    : llama_(IsLlama(dims)), tp_(tp) {
  const int64_t d = dims.hidden_size(), f = dims.ffn_hidden_size();
  TORCH_CHECK(f % tp.size == 0, "tensor_parallel ", tp.size, " must divide ffn_hidden_size ", f);
  if (llama_) {
    gate_ = register_module("gate", ColumnLinear(d, f, false, tp, options));
    up_ = register_module("up", ColumnLinear(d, f, false, tp, options));
    down_ = register_module("down", RowLinear(f, d, false, tp, options));
  } else {
    up_ = register_module("fc", ColumnLinear(d, f, true, tp, options));
    down_ = register_module("proj", RowLinear(f, d, true, tp, options));
  }
}

torch::Tensor MlpImpl::forward(const torch::Tensor& input) {
  const torch::Tensor x = EnterTensorParallel(input, tp_);
  auto down = [this](const torch::Tensor& h) {
    return AddLoraDelta(RowParallelForward(down_, h, tp_), down_lora_, h, is_training());
  };
  if (!recompute_activation_) {
    if (llama_) {
      return down(FusedSwiGlu(Project(gate_, gate_lora_, x), Project(up_, up_lora_, x)));
    }
    return down(FusedGeluTanh(Project(up_, up_lora_, x)));
  }
  // The down projection saves the activation's output; CheckpointWithoutOutput frees it and
  // recomputes it from the projections' outputs just before the down projection's backward.
  auto down_of_first = [&down](const std::vector<torch::Tensor>& in) { return down(in[0]); };
  if (llama_) {
    return CheckpointWithoutOutput(
        [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
          return {FusedSwiGlu(in[0], in[1])};
        },
        {Project(gate_, gate_lora_, x), Project(up_, up_lora_, x)}, down_of_first);
  }
  return CheckpointWithoutOutput(
      [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
        return {FusedGeluTanh(in[0])};
      },
      {Project(up_, up_lora_, x)}, down_of_first);
}

void MlpImpl::AddLora(const LoraOptions& options) {
  using enum LinearSplit;
  AttachLora("mlp", "gate", gate_, options, kColumn, tp_, &gate_lora_);
  AttachLora("mlp", "up", up_, options, kColumn, tp_, &up_lora_);
  AttachLora("mlp", llama_ ? "down" : "proj", down_, options, kRow, tp_, &down_lora_);
  AttachLora("mlp", "fc", up_, options, kColumn, tp_, &up_lora_);
}

MoeOptions MoeOptionsOf(const v1::ModelDims& dims, double init_std) {
  const int64_t shared = dims.shared_expert_intermediate_size();
  return MoeOptions{.hidden_size = dims.hidden_size(),
                    .num_experts = dims.num_experts(),
                    .top_k = dims.num_experts_per_token(),
                    .expert_intermediate_size = dims.moe_intermediate_size(),
                    .norm_topk_prob = dims.norm_topk_prob(),
                    .num_shared_experts = shared > 0 ? 1 : 0,
                    .shared_intermediate_size = shared,
                    .shared_expert_gate = true,
                    .aux_loss_coef = dims.router_aux_loss_coef(),
                    .init_std = init_std};
}

BlockImpl::BlockImpl(const v1::ModelDims& dims, const TensorParallel& tp,
                     const torch::TensorOptions& options, const ExpertParallel& ep) {
  const bool rms = IsLlama(dims);
  attn_norm_ = register_module(
      "attn_norm", Norm(dims.hidden_size(), dims.norm_eps(), rms, !tp.enabled(), options));
  attn_ = register_module("attn", Attention(dims, tp, options));
  mlp_norm_ = register_module(
      "mlp_norm", Norm(dims.hidden_size(), dims.norm_eps(), rms, !tp.enabled(), options));
  if (dims.num_experts() > 0) {
    // The model draws every parameter itself (CausalLMImpl::InitialValue).
    moe_ = register_module("mlp",
                           MoeLayer(MoeOptionsOf(dims, planner::kDefaultInitStd), options, ep, tp));
  } else {
    mlp_ = register_module("mlp", Mlp(dims, tp, options));
  }
}

void BlockImpl::SetActivationCheckpointing(v1::ActivationCheckpointing mode) {
  const bool selective = mode == v1::ACTIVATION_CHECKPOINTING_SELECTIVE;
  attn_->set_recompute_core(selective);
  if (mlp_) mlp_->set_recompute_activation(selective);  // an MoE layer keeps its activations
}

void BlockImpl::AddLora(const LoraOptions& options) {
  attn_->AddLora(options);
  if (mlp_) {
    mlp_->AddLora(options);
    return;
  }
  moe_->AddLora(options.rank, options.scale, options.dropout, options.targets);
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const torch::Tensor& mask) {
  // Under autocast a float32 residual stream plus a 16-bit branch: one vectorised kernel on CUDA
  // (ResidualAdd), bit for bit ATen's add. The residual input comes through its norm, whose
  // backward then adds the gradient arriving through the residual connection to the one through
  // the branch in its own pass (FusedRmsNormKeepingInput).
  const NormAndInput attn_in = attn_norm_->ForwardKeepingInput(x);
  torch::Tensor h = ResidualAdd(attn_in.x_kept, attn_->forward(attn_in.y, cos, sin, mask));
  const NormAndInput mlp_in = mlp_norm_->ForwardKeepingInput(h);
  if (mlp_) return ResidualAdd(mlp_in.x_kept, mlp_->forward(mlp_in.y));
  MoeOutput moe = moe_->forward(mlp_in.y);
  last_router_ = RouterStats{.tokens_per_expert = moe.tokens_per_expert,
                             .router_prob_mean = moe.router_prob_mean};
  return ResidualAdd(mlp_in.x_kept, moe.output);
}

CausalLMImpl::CausalLMImpl(const v1::ModelDims& dims, double init_std,
                           const ModelPartition& partition, ParameterStorage storage)
    : dims_(dims),
      partition_(partition),
      storage_(storage),
      init_std_(init_std > 0 ? init_std : planner::kDefaultInitStd) {
  init_seed_ = static_cast<uint64_t>(
      torch::randint(0, std::numeric_limits<int64_t>::max(), {1}, torch::kInt64).item<int64_t>());
  TORCH_CHECK(dims.num_layers() > 0 && dims.hidden_size() > 0 && dims.vocab_size() > 0 &&
                  dims.max_seq_len() > 0 && dims.num_attention_heads() > 0 &&
                  dims.num_kv_heads() > 0 && dims.head_dim() > 0 && dims.ffn_hidden_size() > 0 &&
                  dims.norm_eps() > 0,
              "CausalLM needs resolved ModelDims (see planner::ResolveModel), got ",
              dims.ShortDebugString());
  const TensorParallel& tp = partition_.tp;
  TORCH_CHECK(tp.size >= 1 && tp.rank >= 0 && tp.rank < tp.size, "tensor-parallel rank ", tp.rank,
              " of ", tp.size);
  TORCH_CHECK(dims.vocab_size() >= tp.size, "tensor_parallel ", tp.size, " exceeds the vocabulary");
  if (partition_.num_layers < 0) partition_.num_layers = dims.num_layers() - partition_.first_layer;
  TORCH_CHECK(partition_.chunks >= 1 &&
                  (partition_.chunks == 1 || partition_.chunk_stride >= partition_.num_layers),
              partition_.chunks, " chunks ", partition_.chunk_stride,
              " layers apart overlap chunks of ", partition_.num_layers, " layers");
  const int last_chunk_end = partition_.first_layer +
                             (partition_.chunks - 1) * partition_.chunk_stride +
                             partition_.num_layers;
  TORCH_CHECK(partition_.first_layer >= 0 && partition_.num_layers >= 0 &&
                  last_chunk_end <= dims.num_layers(),
              "layers [", partition_.first_layer, ", ", last_chunk_end, ") outside the model's ",
              dims.num_layers());
  const int64_t d = dims.hidden_size();
  const int64_t local_vocab = VocabRowsPerRank(dims.vocab_size(), tp.size);
  const bool llama = IsLlama(dims);
  const torch::TensorOptions options =
      torch::TensorOptions(torch::kFloat32)
          .device(storage == ParameterStorage::kDeferred ? torch::kMeta : torch::kCPU);
  if (partition_.embedding || (partition_.head && dims.tie_embeddings())) {
    embed_ = register_module("embed", EmbeddingTable(local_vocab, d, options));
  }
  if (!llama && partition_.embedding) {
    pos_embed_ = register_module("pos_embed", EmbeddingTable(dims.max_seq_len(), d, options));
  }
  layers_ = register_module("layers", torch::nn::ModuleDict());
  for (int chunk = 0; chunk < partition_.chunks; ++chunk) {
    for (int i = 0; i < partition_.num_layers; ++i) {
      Block block(dims, tp, options, partition_.ep);
      block->attention()->set_context_parallel(partition_.cp);
      const int layer = partition_.first_layer + chunk * partition_.chunk_stride + i;
      layers_->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
          {std::to_string(layer), block.ptr()}});
      blocks_.push_back(block.ptr());
    }
  }
  if (partition_.head) {
    final_norm_ =
        register_module("final_norm", Norm(d, dims.norm_eps(), llama, !tp.enabled(), options));
    if (!dims.tie_embeddings()) {
      lm_head_ = register_parameter("lm_head", torch::empty({local_vocab, d}, options));
    }
  }
  if (llama) {
    auto [cos, sin] = RotaryTables(dims.max_seq_len(), dims.head_dim(), dims.rope_theta());
    rope_cos_ = register_buffer("rope_cos", cos);
    rope_sin_ = register_buffer("rope_sin", sin);
  }
  for (const auto& item : named_parameters()) {
    ParamShard shard = ShardOfParameter(item.key(), {});
    std::vector<int64_t> shape = item.value().sizes().vec();
    switch (shard.kind) {
      case ParamShard::Kind::kReplicated:
        break;
      case ParamShard::Kind::kColumn:
        shape[0] *= tp.size;
        break;
      case ParamShard::Kind::kRow:
        shape[1] *= tp.size;
        break;
      case ParamShard::Kind::kVocab:
        shape[0] = dims.vocab_size();
        break;
      case ParamShard::Kind::kExpertColumn:
        shape[1] *= tp.size;
        break;
      case ParamShard::Kind::kExpertRow:
        shape[2] *= tp.size;
        break;
    }
    if (IsExpertParameter(item.key())) shape[0] *= partition_.ep.size;
    shard.global_shape = shape;
    shards_.emplace(item.key(), std::move(shard));
  }
  if (storage_ == ParameterStorage::kInitialized) {
    torch::NoGradGuard no_grad;
    for (const auto& item : named_parameters()) item.value().copy_(InitialValue(item.key()));
  }
}

void CausalLMImpl::AddLora(const LoraOptions& options) {
  TORCH_CHECK(options.rank > 0, "LoRA rank must be > 0, got ", options.rank);
  TORCH_CHECK(lora_.rank == 0, "LoRA adapters were already added");
  TORCH_CHECK(storage_ == ParameterStorage::kInitialized,
              "LoRA adapters need a model built with its parameters (kInitialized)");
  TORCH_CHECK(options.dropout >= 0 && options.dropout < 1, "LoRA dropout must be in [0, 1), got ",
              options.dropout);
  for (auto& param : parameters()) param.requires_grad_(false);
  for (auto& block : blocks_) block->AddLora(options);
  lora_ = options;
  torch::NoGradGuard no_grad;
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    if (!IsLoraParameter(name)) continue;
    torch::Tensor param = item.value();
    const bool expert = IsExpertLoraParameter(name);
    const ParamShard& shard = shards_[name] =
        LoraShardOf(name, param.sizes().vec(), ShardOf(LoraBaseParameterName(name)),
                    partition_.tp.size, expert ? partition_.ep.size : 1);
    if (absl::EndsWith(name, ".lora_b")) continue;  // zero: the model starts as the base
    // PEFT's kaiming_uniform(a=sqrt(5)) bound over the whole input width (the last dim; an MoE
    // layer's adapters are stacked [experts, rank, in]). Drawn whole and cut to this rank's part,
    // so that every tp and ep split starts from the same adapters.
    const double bound = 1.0 / std::sqrt(static_cast<double>(shard.global_shape.back()));
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(init_seed_ ^ NameHash(name));
    torch::Tensor full = torch::empty(shard.global_shape, param.options());
    full.uniform_(-bound, bound, generator);
    param.copy_(expert ? LocalExpertShardOf(full, shard, partition_.ep, partition_.tp)
                       : LocalShardOf(full, shard, partition_.tp.rank, partition_.tp.size));
  }
}

void CausalLMImpl::SetMaterialized() {
  for (const auto& param : parameters()) {
    TORCH_CHECK(!param.is_meta(), "a parameter of the model has no memory yet");
  }
  storage_ = ParameterStorage::kInitialized;
}

void CausalLMImpl::MoveTo(torch::Device device) {
  if (storage_ == ParameterStorage::kInitialized) return to(device);
  for (auto& buffer : buffers()) buffer.set_data(buffer.to(device));
}

torch::Tensor CausalLMImpl::InitialValue(const std::string& name) const {
  torch::NoGradGuard no_grad;
  const ParamShard& shard = ShardOf(name);
  torch::Tensor full;
  if (absl::StrContains(name, "norm.")) {
    full = absl::EndsWith(name, ".bias") ? torch::zeros(shard.global_shape)
                                         : torch::ones(shard.global_shape);
  } else if (absl::EndsWith(name, ".bias")) {
    full = torch::zeros(shard.global_shape);
  } else {
    // GPT-2's scaling: each block adds two residual branches, so their output projections start
    // smaller to keep the residual stream's variance independent of depth.
    const bool residual =
        absl::EndsWith(name, ".attn.proj.weight") || absl::EndsWith(name, ".attn.o.weight") ||
        absl::EndsWith(name, ".mlp.proj.weight") || absl::EndsWith(name, ".mlp.down.weight") ||
        absl::EndsWith(name, ".mlp.experts.down") || absl::EndsWith(name, ".mlp.shared.down");
    const double std = residual ? init_std_ / std::sqrt(2.0 * dims_.num_layers()) : init_std_;
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(init_seed_ ^ NameHash(name));
    full = torch::empty(shard.global_shape, torch::kFloat32);
    full.normal_(0.0, std, generator);
  }
  if (IsExpertParameter(name)) return LocalExpertShardOf(full, shard, partition_.ep, partition_.tp);
  return LocalShardOf(full, shard, partition_.tp.rank, partition_.tp.size);
}

const ParamShard& CausalLMImpl::ShardOf(const std::string& name) const {
  auto it = shards_.find(name);
  TORCH_CHECK(it != shards_.end(), "no parameter ", name, " on this rank");
  return it->second;
}

std::vector<std::string> CausalLMImpl::AllParameterNames() const {
  std::vector<std::string> names = {"embed.weight"};
  const bool llama = IsLlama(dims_);
  if (!llama) names.push_back("pos_embed.weight");
  // One layer's names, from a layer this rank holds (every stage holds at least one).
  std::vector<std::string> suffixes;
  const std::string prefix = absl::StrCat("layers.", partition_.first_layer, ".");
  for (const auto& item : named_parameters()) {
    if (absl::StartsWith(item.key(), prefix)) suffixes.push_back(item.key().substr(prefix.size()));
  }
  for (int i = 0; i < dims_.num_layers(); ++i) {
    for (const std::string& suffix : suffixes)
      names.push_back(absl::StrCat("layers.", i, ".", suffix));
  }
  names.push_back("final_norm.weight");
  if (!llama) names.push_back("final_norm.bias");
  if (!dims_.tie_embeddings()) names.push_back("lm_head");
  return names;
}

std::vector<std::string> CausalLMImpl::TrainableParameterNames() const {
  std::vector<std::string> names = AllParameterNames();
  if (lora_.rank > 0) std::erase_if(names, [](const std::string& n) { return !IsLoraParameter(n); });
  return names;
}

torch::Tensor CausalLMImpl::Embed(const torch::Tensor& tokens, const torch::Tensor& positions) {
  const TensorParallel& tp = partition_.tp;
  const int64_t seq = tokens.size(1);
  torch::Tensor h;
  if (!tp.enabled()) {
    h = embed_->forward(tokens);
  } else {
    // Vocab-parallel: each rank looks up the tokens in its rows, zeros elsewhere, and the sum over
    // tp (or its sequence shard of it) is the embedding.
    const int64_t rows = embed_->weight.size(0);
    torch::Tensor local = tokens - tp.rank * rows;
    torch::Tensor mine = (local >= 0).logical_and(local < rows);
    h = embed_->forward(local.masked_fill(mine.logical_not(), 0)) *
        mine.unsqueeze(-1).to(embed_->weight.scalar_type());
    h = ExitTensorParallel(h, tp);
  }
  if (pos_embed_) {
    const bool split = tp.enabled() && tp.sequence_parallel;
    const int64_t part = split ? seq / tp.size : seq;
    const int64_t first = split ? tp.rank * part : 0;
    if (partition_.cp.enabled()) {
      // The cp rank's tokens sit at global positions of two chunks, not at 0 .. seq.
      TORCH_CHECK(!positions.defined(), "context parallelism runs without packed records");
      h = h + pos_embed_->forward(ContextPositions(seq).narrow(0, first, part));
    } else {
      h = h + (positions.defined() ? pos_embed_->forward(positions.narrow(1, first, part))
                                   : pos_embed_->weight.narrow(0, first, part));
    }
  }
  return h;
}

torch::Tensor CausalLMImpl::ContextPositions(int64_t local_seq) const {
  const ContextParallel& cp = partition_.cp;
  const torch::Device device =
      rope_cos_.defined() ? rope_cos_.device() : pos_embed_->weight.device();
  return ContextParallelPositions(local_seq * cp.size, cp.rank, cp.size).to(device);
}

int CausalLMImpl::LocalLayerIndex(int layer) const {
  const int offset = layer - partition_.first_layer;
  if (offset < 0) return -1;
  const int chunk = partition_.chunks == 1 ? 0 : offset / partition_.chunk_stride;
  const int within = offset - chunk * partition_.chunk_stride;
  if (chunk >= partition_.chunks || within >= partition_.num_layers) return -1;
  return chunk * partition_.num_layers + within;
}

torch::Tensor CausalLMImpl::RunLayers(torch::Tensor h, const torch::Tensor& positions, int begin,
                                      int end) {
  if (end < 0) end = num_local_layers();
  const TensorParallel& tp = partition_.tp;
  const int64_t seq = h.size(1) * (tp.enabled() && tp.sequence_parallel ? tp.size : 1);
  torch::Tensor cos, sin, mask;
  if (positions.defined()) {
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == h.size(0) && positions.size(1) == seq,
                "positions must be [batch, seq] = [", h.size(0), ", ", seq, "], got ",
                positions.sizes());
    TORCH_CHECK(!partition_.cp.enabled(), "context parallelism runs without packed records");
    mask = RecordMask(positions);
  }
  if (rope_cos_.defined()) {
    if (positions.defined()) {
      // [batch, 1, seq, head_dim]: each token's angles from its own record's start.
      const auto shape = std::vector<int64_t>{positions.size(0), 1, seq, rope_cos_.size(1)};
      cos = rope_cos_.index_select(0, positions.reshape({-1})).view(shape);
      sin = rope_sin_.index_select(0, positions.reshape({-1})).view(shape);
    } else if (partition_.cp.enabled()) {
      const torch::Tensor global = ContextPositions(seq);
      cos = rope_cos_.index_select(0, global);
      sin = rope_sin_.index_select(0, global);
    } else {
      cos = rope_cos_.narrow(0, 0, seq);
      sin = rope_sin_.narrow(0, 0, seq);
    }
  }
  router_stats_.clear();
  for (int i = begin; i < end; ++i) {
    if (hooks_ != nullptr) hooks_->BeforeLayer(i);
    std::shared_ptr<BlockImpl> block = blocks_[i];
    if (checkpointing_ == v1::ACTIVATION_CHECKPOINTING_FULL) {
      // An MoE block's router probabilities leave the checkpoint as a second output, so that the
      // load-balancing loss backpropagates through the recomputed router.
      std::vector<torch::Tensor> out = Checkpoint(
          [block, cos, sin, mask](const std::vector<torch::Tensor>& in) {
            std::vector<torch::Tensor> result = {block->forward(in[0], cos, sin, mask)};
            if (block->is_moe()) result.push_back(block->last_router().router_prob_mean);
            return result;
          },
          {h});
      h = out[0];
      if (block->is_moe()) {
        router_stats_.push_back(
            RouterStats{.tokens_per_expert = block->last_router().tokens_per_expert,
                        .router_prob_mean = out[1]});
      }
    } else {
      h = block->forward(h, cos, sin, mask);
      if (block->is_moe()) router_stats_.push_back(block->last_router());
    }
    if (hooks_ != nullptr) h = hooks_->AfterLayer(i, std::move(h));
  }
  return h;
}

torch::Tensor CausalLMImpl::RouterAuxLoss() {
  std::vector<torch::Tensor> counts, probs;
  for (const RouterStats& stats : router_stats_) {
    counts.push_back(stats.tokens_per_expert);
    probs.push_back(stats.router_prob_mean);
  }
  const torch::Tensor per_layer = torch::stack(counts);  // [layers, experts]
  const torch::Tensor prob_mean = torch::stack(probs);   // [layers, experts]
  // f_le sums to top_k over e: a share of the layer's tokens (its slots / top_k), not of its
  // slots. Every layer of a forward call routes the same tokens.
  const torch::Tensor tokens =
      per_layer.sum(1, /*keepdim=*/true).to(prob_mean.scalar_type()) /
      static_cast<double>(dims_.num_experts_per_token());
  const torch::Tensor fraction = per_layer.to(prob_mean.scalar_type()) / tokens;
  // This call's layers' share of the mean over all the model's layers (see the header).
  torch::Tensor aux = static_cast<double>(dims_.num_experts()) * (fraction * prob_mean).sum() /
                      static_cast<double>(dims_.num_layers());
  last_router_aux_loss_ = aux.detach();
  last_tokens_per_expert_ = per_layer;
  return aux;
}

void CausalLMImpl::SumRouterAuxLossOver(c10d::ProcessGroup& pipeline) {
  torch::Tensor aux;
  std::vector<const ChunkRouting*> routed;
  for (const ChunkRouting& chunk : chunk_routing_) {
    if (!chunk.aux_loss.defined()) continue;
    aux = aux.defined() ? aux + chunk.aux_loss : chunk.aux_loss.clone();
    routed.push_back(&chunk);
  }
  // Every stage of an MoE model routes in each of its layers, so each one joins both
  // collectives; a dense model's stages skip them all alike.
  if (!aux.defined()) return;
  // Each stage fills the rows of its own layers; the sum over the stages holds every layer's.
  torch::Tensor counts =
      torch::zeros({dims_.num_layers(), dims_.num_experts()},
                   torch::TensorOptions().dtype(torch::kInt64).device(aux.device()));
  for (const ChunkRouting* chunk : routed) {
    for (size_t i = 0; i < chunk->moe_layers.size(); ++i) {
      counts[chunk->moe_layers[i]].copy_(chunk->tokens_per_expert[static_cast<int64_t>(i)]);
    }
  }
  std::vector<torch::Tensor> tensors{aux.reshape({1}), counts};
  for (torch::Tensor& tensor : tensors) {
    std::vector<torch::Tensor> one{tensor};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, &pipeline, TensorBytes(one), tensor.is_cuda());
    WaitForPeers(pipeline.allreduce(one), issue);
  }
  last_router_aux_loss_ = tensors[0].reshape({});
  last_tokens_per_expert_ = tensors[1];
}

torch::Tensor CausalLMImpl::HeadLoss(const torch::Tensor& hidden, const torch::Tensor& targets) {
  const TensorParallel& tp = partition_.tp;
  torch::Tensor h = final_norm_->forward(hidden);
  const torch::Tensor& weight = lm_head_.defined() ? lm_head_ : embed_->weight;
  if (!tp.enabled()) {
    // Sum over the counted targets / their number (1 when none: an all-masked batch has loss
    // 0 and zero gradients, where cross_entropy's mean would be 0 / 0), a chunk of tokens at a
    // time: the whole [tokens, vocab] logits never exist.
    return LinearCrossEntropy(h.reshape({-1, h.size(-1)}), weight, targets.reshape({-1}));
  }
  torch::Tensor logits = F::linear(EnterTensorParallel(h, tp), weight);
  const int64_t rows = weight.size(0);
  const int64_t begin = tp.rank * rows;
  const int64_t valid = std::clamp<int64_t>(dims_.vocab_size() - begin, 0, rows);
  return VocabParallelCrossEntropy(logits.reshape({-1, rows}), targets.reshape({-1}), begin, valid,
                                   tp);
}

torch::Tensor CausalLMImpl::StageForward(const torch::Tensor& input, const torch::Tensor& targets,
                                         const torch::Tensor& positions, int chunk) {
  TORCH_CHECK(chunk >= 0 && chunk < partition_.chunks, "chunk ", chunk, " of ", partition_.chunks);
  const bool embeds = partition_.embedding && chunk == 0;
  const bool heads = partition_.head && chunk == partition_.chunks - 1;
  torch::Tensor h = input;
  if (embeds) {
    TORCH_CHECK(input.dim() == 2, "tokens must be [batch, seq], got ", input.sizes());
    const int64_t global_seq = input.size(1) * partition_.cp.size;
    TORCH_CHECK(global_seq <= dims_.max_seq_len(), "sequence length ", global_seq,
                " exceeds max_seq_len ", dims_.max_seq_len());
    const TensorParallel& tp = partition_.tp;
    TORCH_CHECK(!tp.enabled() || !tp.sequence_parallel || input.size(1) % tp.size == 0,
                "sequence length ", input.size(1), " is not divisible by tensor_parallel ", tp.size,
                " (sequence parallelism splits it)");
    h = Embed(input, positions);
  }
  h = RunLayers(std::move(h), positions, chunk * partition_.num_layers,
                (chunk + 1) * partition_.num_layers);
  // A stage's router loss covers its own layers (RouterAuxLoss): the gradient of each layer's
  // term flows in the stage that routed with it, and the stages' terms add up to the model's.
  torch::Tensor aux;
  if (!router_stats_.empty()) {
    aux = RouterAuxLoss();
    // Kept per chunk for the step's report (SumRouterAuxLossOver): an interleaved stage runs
    // its chunks one after another, and last_router_aux_loss then holds the last one's only.
    if (chunk_routing_.size() < static_cast<size_t>(partition_.chunks)) {
      chunk_routing_.resize(partition_.chunks);
    }
    ChunkRouting& routing = chunk_routing_[chunk];
    routing.aux_loss = last_router_aux_loss_;
    routing.tokens_per_expert = last_tokens_per_expert_;
    routing.moe_layers.clear();
    for (int i = 0; i < partition_.num_layers; ++i) {
      if (blocks_[chunk * partition_.num_layers + i]->is_moe()) {
        routing.moe_layers.push_back(partition_.first_layer + chunk * partition_.chunk_stride + i);
      }
    }
  }
  const bool adds_aux =
      aux.defined() && is_training() && dims_.router_aux_loss_coef() != 0;
  if (!heads) {
    return adds_aux ? AttachAuxLoss(h, dims_.router_aux_loss_coef() * aux, aux_loss_scale_.get())
                    : h;
  }
  TORCH_CHECK(targets.defined(), "the last stage needs targets");
  torch::Tensor loss = HeadLoss(h, targets);
  if (!adds_aux) return loss;
  return loss + dims_.router_aux_loss_coef() * aux.to(loss.scalar_type());
}

torch::Tensor CausalLMImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions) {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be [batch, seq], got ", tokens.sizes());
  TORCH_CHECK(partition_.embedding && partition_.head && !partition_.tp.enabled(),
              "forward() needs the whole model on one rank; use StageForward");
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= dims_.max_seq_len(), "sequence length ", seq, " exceeds max_seq_len ",
              dims_.max_seq_len());
  torch::Tensor h = final_norm_->forward(RunLayers(Embed(tokens, positions), positions));
  if (!router_stats_.empty()) RouterAuxLoss();
  return F::linear(h, lm_head_.defined() ? lm_head_ : embed_->weight);
}

torch::Tensor CausalLMImpl::Loss(const torch::Tensor& inputs, const torch::Tensor& targets,
                                 const torch::Tensor& positions) {
  TORCH_CHECK(inputs.sizes() == targets.sizes(), "inputs ", inputs.sizes(), " and targets ",
              targets.sizes(), " differ in shape");
  TORCH_CHECK(partition_.embedding && partition_.head, "Loss() needs every pipeline stage");
  return StageForward(inputs, targets, positions);
}

void CausalLMImpl::SetActivationCheckpointing(v1::ActivationCheckpointing mode) {
  TORCH_CHECK(v1::ActivationCheckpointing_IsValid(mode), "unknown activation checkpointing mode ",
              static_cast<int>(mode));
  checkpointing_ =
      mode == v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED ? v1::ACTIVATION_CHECKPOINTING_NONE : mode;
  for (auto& block : blocks_) block->SetActivationCheckpointing(checkpointing_);
}

std::vector<std::pair<std::string, torch::Tensor>> CausalLMImpl::LayerParameters(int layer) {
  TORCH_CHECK(layer == -1 || LocalLayerIndex(layer) >= 0, "layer ", layer, " is not held here (",
              partition_.chunks, " chunks of ", partition_.num_layers, " layers from ",
              partition_.first_layer, ", ", partition_.chunk_stride, " apart)");
  const std::string layer_prefix = "layers.";
  const std::string prefix = layer_prefix + std::to_string(layer) + ".";
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : named_parameters()) {
    const bool selected =
        layer >= 0 ? item.key().starts_with(prefix) : !item.key().starts_with(layer_prefix);
    if (selected) out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<torch::Tensor> CausalLMImpl::DecayParameters() {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters()) {
    if (p.dim() >= 2) out.push_back(p);
  }
  return out;
}

std::vector<torch::Tensor> CausalLMImpl::NoDecayParameters() {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters()) {
    if (p.dim() < 2) out.push_back(p);
  }
  return out;
}

}  // namespace tessera::trainer
