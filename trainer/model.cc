#include "trainer/model.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "planner/model_config.h"
#include "trainer/activation_checkpoint.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

bool IsLlama(const v1::ModelDims& dims) { return dims.architecture() == v1::ARCHITECTURE_LLAMA; }

torch::nn::Linear MakeLinear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
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
  torch::Tensor x32 = x.to(torch::kFloat32);
  return (x32 * cos + RotateHalf(x32) * sin).to(x.scalar_type());
}

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  torch::Tensor x32 = x.to(torch::kFloat32);
  torch::Tensor normed = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight.to(torch::kFloat32)).to(x.scalar_type());
}

NormImpl::NormImpl(int64_t size, double eps, bool rms) : eps_(eps), rms_(rms) {
  weight_ = register_parameter("weight", torch::ones({size}));
  if (!rms_) bias_ = register_parameter("bias", torch::zeros({size}));
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (rms_) return RmsNorm(x, weight_, eps_);
  // Autocast runs layer_norm in float32 on its own; the explicit cast covers CPU and no-autocast.
  return at::layer_norm(x.to(torch::kFloat32), {weight_.size(0)}, weight_, bias_, eps_)
      .to(x.scalar_type());
}

AttentionImpl::AttentionImpl(const v1::ModelDims& dims)
    : llama_(IsLlama(dims)),
      heads_(dims.num_attention_heads()),
      kv_heads_(dims.num_kv_heads()),
      head_dim_(dims.head_dim()) {
  const int64_t d = dims.hidden_size();
  const int64_t q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
  if (llama_) {
    q_ = register_module("q", MakeLinear(d, q_width, false));
    k_ = register_module("k", MakeLinear(d, kv_width, false));
    v_ = register_module("v", MakeLinear(d, kv_width, false));
    out_ = register_module("o", MakeLinear(q_width, d, false));
    if (dims.qk_norm()) {
      // One weight of size head_dim shared by all heads, as in Qwen3.
      q_norm_ = register_module("q_norm", Norm(head_dim_, dims.norm_eps(), /*rms=*/true));
      k_norm_ = register_module("k_norm", Norm(head_dim_, dims.norm_eps(), /*rms=*/true));
    }
  } else {
    qkv_ = register_module("qkv", MakeLinear(d, 3 * q_width, true));
    out_ = register_module("proj", MakeLinear(q_width, d, true));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin) {
  const int64_t batch = x.size(0), seq = x.size(1);
  torch::Tensor q, k, v;
  if (llama_) {
    q = q_->forward(x).view({batch, seq, heads_, head_dim_});
    k = k_->forward(x).view({batch, seq, kv_heads_, head_dim_});
    v = v_->forward(x).view({batch, seq, kv_heads_, head_dim_}).transpose(1, 2);
    if (q_norm_) {
      q = q_norm_->forward(q);
      k = k_norm_->forward(k);
    }
    q = ApplyRotary(q.transpose(1, 2), cos, sin);
    k = ApplyRotary(k.transpose(1, 2), cos, sin);
  } else {
    // [batch, seq, 3, heads, head_dim] -> three [batch, heads, seq, head_dim].
    auto qkv = qkv_->forward(x).view({batch, seq, 3, heads_, head_dim_}).permute({2, 0, 3, 1, 4});
    q = qkv[0];
    k = qkv[1];
    v = qkv[2];
  }
  torch::Tensor out =
      recompute_core_
          ? Checkpoint(
                [this](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
                  return {Core(in[0], in[1], in[2])};
                },
                {q, k, v})[0]
          : Core(q, k, v);
  return out_->forward(out.transpose(1, 2).reshape({batch, seq, heads_ * head_dim_}));
}

torch::Tensor AttentionImpl::Core(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) const {
  // enable_gqa lets the kernel share each kv head across its query group instead of
  // materialising repeated k and v.
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0,
                                          /*is_causal=*/true, /*scale=*/std::nullopt,
                                          /*enable_gqa=*/kv_heads_ != heads_);
}

MlpImpl::MlpImpl(const v1::ModelDims& dims) : llama_(IsLlama(dims)) {
  const int64_t d = dims.hidden_size(), f = dims.ffn_hidden_size();
  if (llama_) {
    gate_ = register_module("gate", MakeLinear(d, f, false));
    up_ = register_module("up", MakeLinear(d, f, false));
    down_ = register_module("down", MakeLinear(f, d, false));
  } else {
    up_ = register_module("fc", MakeLinear(d, f, true));
    down_ = register_module("proj", MakeLinear(f, d, true));
  }
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  if (!recompute_activation_) {
    if (llama_) return down_->forward(torch::silu(gate_->forward(x)) * up_->forward(x));
    return down_->forward(torch::gelu(up_->forward(x), "tanh"));
  }
  // The down projection saves the activation's output; CheckpointWithoutOutput frees it and
  // recomputes it from the projections' outputs just before the down projection's backward.
  auto down = [this](const std::vector<torch::Tensor>& in) { return down_->forward(in[0]); };
  if (llama_) {
    return CheckpointWithoutOutput(
        [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
          return {torch::silu(in[0]) * in[1]};
        },
        {gate_->forward(x), up_->forward(x)}, down);
  }
  return CheckpointWithoutOutput(
      [](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
        return {torch::gelu(in[0], "tanh")};
      },
      {up_->forward(x)}, down);
}

BlockImpl::BlockImpl(const v1::ModelDims& dims) {
  const bool rms = IsLlama(dims);
  attn_norm_ = register_module("attn_norm", Norm(dims.hidden_size(), dims.norm_eps(), rms));
  attn_ = register_module("attn", Attention(dims));
  mlp_norm_ = register_module("mlp_norm", Norm(dims.hidden_size(), dims.norm_eps(), rms));
  mlp_ = register_module("mlp", Mlp(dims));
}

void BlockImpl::SetActivationCheckpointing(v1::ActivationCheckpointing mode) {
  const bool selective = mode == v1::ACTIVATION_CHECKPOINTING_SELECTIVE;
  attn_->set_recompute_core(selective);
  mlp_->set_recompute_activation(selective);
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin) {
  torch::Tensor h = x + attn_->forward(attn_norm_->forward(x), cos, sin);
  return h + mlp_->forward(mlp_norm_->forward(h));
}

CausalLMImpl::CausalLMImpl(const v1::ModelDims& dims, double init_std) : dims_(dims) {
  TORCH_CHECK(dims.num_layers() > 0 && dims.hidden_size() > 0 && dims.vocab_size() > 0 &&
                  dims.max_seq_len() > 0 && dims.num_attention_heads() > 0 &&
                  dims.num_kv_heads() > 0 && dims.head_dim() > 0 && dims.ffn_hidden_size() > 0 &&
                  dims.norm_eps() > 0,
              "CausalLM needs resolved ModelDims (see planner::ResolveModel), got ",
              dims.ShortDebugString());
  const int64_t d = dims.hidden_size(), vocab = dims.vocab_size();
  const bool llama = IsLlama(dims);
  embed_ = register_module("embed", torch::nn::Embedding(vocab, d));
  if (!llama)
    pos_embed_ = register_module("pos_embed", torch::nn::Embedding(dims.max_seq_len(), d));
  layers_ = register_module("layers", torch::nn::ModuleList());
  for (int i = 0; i < dims.num_layers(); ++i) layers_->push_back(Block(dims));
  final_norm_ = register_module("final_norm", Norm(d, dims.norm_eps(), llama));
  if (!dims.tie_embeddings()) lm_head_ = register_parameter("lm_head", torch::empty({vocab, d}));
  if (llama) {
    auto [cos, sin] = RotaryTables(dims.max_seq_len(), dims.head_dim(), dims.rope_theta());
    rope_cos_ = register_buffer("rope_cos", cos);
    rope_sin_ = register_buffer("rope_sin", sin);
  }
  Initialize(init_std > 0 ? init_std : planner::kDefaultInitStd);
}

void CausalLMImpl::Initialize(double init_std) {
  torch::NoGradGuard no_grad;
  // GPT-2's scaling: each block adds two residual branches, so their output projections start
  // smaller to keep the residual stream's variance independent of depth.
  const double residual_std = init_std / std::sqrt(2.0 * dims_.num_layers());
  for (auto& module : modules(/*include_self=*/false)) {
    if (auto* linear = module->as<torch::nn::Linear>()) {
      torch::nn::init::normal_(linear->weight, 0.0, init_std);
      if (linear->bias.defined()) torch::nn::init::zeros_(linear->bias);
    } else if (auto* embedding = module->as<torch::nn::Embedding>()) {
      torch::nn::init::normal_(embedding->weight, 0.0, init_std);
    }
  }
  for (auto& layer : *layers_) {
    auto* block = layer->as<BlockImpl>();
    torch::nn::init::normal_(block->attention()->output_projection()->weight, 0.0, residual_std);
    torch::nn::init::normal_(block->mlp()->output_projection()->weight, 0.0, residual_std);
  }
  if (lm_head_.defined()) torch::nn::init::normal_(lm_head_, 0.0, init_std);
}

torch::Tensor CausalLMImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= dims_.max_seq_len(), "sequence length ", seq, " exceeds max_seq_len ",
              dims_.max_seq_len());
  torch::Tensor h = embed_->forward(tokens);
  torch::Tensor cos, sin;
  if (pos_embed_) {
    h = h + pos_embed_->weight.narrow(0, 0, seq);
  } else {
    cos = rope_cos_.narrow(0, 0, seq);
    sin = rope_sin_.narrow(0, 0, seq);
  }
  for (int i = 0; i < static_cast<int>(layers_->size()); ++i) {
    if (hooks_ != nullptr) hooks_->BeforeLayer(i);
    std::shared_ptr<BlockImpl> block = layers_->ptr<BlockImpl>(i);
    if (checkpointing_ == v1::ACTIVATION_CHECKPOINTING_FULL) {
      h = Checkpoint(
          [block, cos, sin](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
            return {block->forward(in[0], cos, sin)};
          },
          {h})[0];
    } else {
      h = block->forward(h, cos, sin);
    }
    if (hooks_ != nullptr) h = hooks_->AfterLayer(i, std::move(h));
  }
  h = final_norm_->forward(h);
  return F::linear(h, lm_head_.defined() ? lm_head_ : embed_->weight);
}

torch::Tensor CausalLMImpl::Loss(const torch::Tensor& inputs, const torch::Tensor& targets) {
  TORCH_CHECK(inputs.sizes() == targets.sizes(), "inputs ", inputs.sizes(), " and targets ",
              targets.sizes(), " differ in shape");
  torch::Tensor logits = forward(inputs);
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32),
                          targets.reshape({-1}));
}

void CausalLMImpl::SetActivationCheckpointing(v1::ActivationCheckpointing mode) {
  TORCH_CHECK(v1::ActivationCheckpointing_IsValid(mode), "unknown activation checkpointing mode ",
              static_cast<int>(mode));
  checkpointing_ =
      mode == v1::ACTIVATION_CHECKPOINTING_UNSPECIFIED ? v1::ACTIVATION_CHECKPOINTING_NONE : mode;
  for (auto& layer : *layers_) layer->as<BlockImpl>()->SetActivationCheckpointing(checkpointing_);
}

std::vector<std::pair<std::string, torch::Tensor>> CausalLMImpl::LayerParameters(int layer) {
  TORCH_CHECK(layer >= -1 && layer < static_cast<int>(layers_->size()), "layer ", layer,
              " outside [-1, ", layers_->size(), ")");
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
