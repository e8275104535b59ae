#include "trainer/model/moe.h"

#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

// A parameter-only child module, so that the layer's names read "experts.gate" and so on
// (register_parameter takes no dots).
std::shared_ptr<torch::nn::Module> Holder(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

// A parameter of logical shape `shape` of which this rank holds its ep experts (an expert
// tensor, dim 0) and its tp slice (`kind`, tensor_parallel.h): drawn whole and sliced, so that the
// initial weights do not depend on the layout.
torch::Tensor NewParameter(torch::nn::Module& owner, const std::string& name,
                           std::vector<int64_t> shape, const torch::TensorOptions& options,
                           double std, ParamShard::Kind kind = ParamShard::Kind::kReplicated,
                           const TensorParallel& tp = {}, const ExpertParallel& ep = {}) {
  torch::Tensor value = torch::empty(shape, options);
  if (!value.is_meta()) {
    const torch::NoGradGuard no_grad;
    value.normal_(0.0, std);
  }
  const ParamShard shard{.kind = kind, .global_shape = std::move(shape)};
  const bool expert =
      kind == ParamShard::Kind::kExpertColumn || kind == ParamShard::Kind::kExpertRow;
  if (expert) {
    value = LocalExpertShardOf(value, shard, ep, tp);
  } else if (tp.enabled()) {
    value = LocalShardOf(value, shard, tp.rank, tp.size).clone(at::MemoryFormat::Contiguous);
  }
  return owner.register_parameter(name, value);
}

// down (silu(gate x) * up x) for x [n, in] and weights in nn.Linear's [out, in] layout.
torch::Tensor SwiGlu(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& up,
                     const torch::Tensor& down) {
  return at::linear(FusedSwiGlu(at::linear(x, gate), at::linear(x, up)), down);
}

int64_t SharedWidth(const MoeOptions& options) {
  return options.num_shared_experts * options.shared_intermediate_size;
}

// AttachAuxLoss's node. The scale is read when the backward runs, not when the forward did: in a
// 1F1B schedule the backwards of a stage's micro-batches come later and in their own order.
struct AttachAuxLossFunction : torch::autograd::Function<AttachAuxLossFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& aux, int64_t scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["aux_dtype"] = static_cast<int64_t>(aux.scalar_type());
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* scale =
        reinterpret_cast<const AuxLossScale*>(ctx->saved_data["scale"].toInt());
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["aux_dtype"].toInt());
    return {grads[0], torch::full({}, scale->value, grads[0].options().dtype(dtype)),
            torch::Tensor()};
  }
};

}  // namespace

absl::Status ValidateMoeOptions(const MoeOptions& options) {
  auto positive = [](int64_t value, const char* field) {
    return value > 0 ? absl::OkStatus()
                     : absl::InvalidArgumentError(
                           absl::StrCat("moe.", field, " must be positive, got ", value));
  };
  for (absl::Status status :
       {positive(options.hidden_size, "hidden_size"), positive(options.num_experts, "num_experts"),
        positive(options.top_k, "top_k"),
        positive(options.expert_intermediate_size, "expert_intermediate_size")}) {
    if (!status.ok()) return status;
  }
  if (options.top_k > options.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "moe.top_k ", options.top_k, " exceeds moe.num_experts ", options.num_experts));
  }
  if (options.num_shared_experts < 0 || options.shared_intermediate_size < 0 ||
      (options.num_shared_experts > 0) != (options.shared_intermediate_size > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe.num_shared_experts (", options.num_shared_experts,
                     ") and moe.shared_intermediate_size (", options.shared_intermediate_size,
                     ") must both be positive or both be 0"));
  }
  if (!(options.aux_loss_coef >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe.aux_loss_coef must be >= 0, got ", options.aux_loss_coef));
  }
  if (!(options.init_std >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe.init_std must be >= 0, got ", options.init_std));
  }
  return absl::OkStatus();
}

MoeLayerImpl::MoeLayerImpl(const MoeOptions& options, const torch::TensorOptions& tensor_options,
                           ExpertParallel ep, TensorParallel tp)
    : options_(options), ep_(std::move(ep)), tp_(std::move(tp)) {
  const absl::Status valid = ValidateMoeOptions(options);
  TORCH_CHECK(valid.ok(), valid.ToString());
  TORCH_CHECK(ep_.size >= 1 && options.num_experts % ep_.size == 0, "expert_parallel ", ep_.size,
              " does not divide moe.num_experts ", options.num_experts);
  TORCH_CHECK(tp_.size >= 1 && options.expert_intermediate_size % tp_.size == 0 &&
                  SharedWidth(options) % tp_.size == 0,
              "tensor_parallel ", tp_.size, " does not divide moe.expert_intermediate_size ",
              options.expert_intermediate_size, " and the shared experts' width ",
              SharedWidth(options));
  using Kind = ParamShard::Kind;
  const int64_t h = options.hidden_size, e = options.num_experts,
                f = options.expert_intermediate_size;
  const double std = options.init_std;
  router_weight_ = NewParameter(*Holder(*this, "router"), "weight", {e, h}, tensor_options, std);
  auto experts = Holder(*this, "experts");
  expert_gate_ =
      NewParameter(*experts, "gate", {e, f, h}, tensor_options, std, Kind::kExpertColumn, tp_, ep_);
  expert_up_ =
      NewParameter(*experts, "up", {e, f, h}, tensor_options, std, Kind::kExpertColumn, tp_, ep_);
  expert_down_ =
      NewParameter(*experts, "down", {e, h, f}, tensor_options, std, Kind::kExpertRow, tp_, ep_);
  if (options.num_shared_experts > 0) {
    const int64_t s = SharedWidth(options);
    auto shared = Holder(*this, "shared");
    shared_gate_ = NewParameter(*shared, "gate", {s, h}, tensor_options, std, Kind::kColumn, tp_);
    shared_up_ = NewParameter(*shared, "up", {s, h}, tensor_options, std, Kind::kColumn, tp_);
    shared_down_ = NewParameter(*shared, "down", {h, s}, tensor_options, std, Kind::kRow, tp_);
    if (options.shared_expert_gate) {
      shared_sigmoid_gate_ = NewParameter(*shared, "sigmoid_gate", {1, h}, tensor_options, std);
    }
  }
}

torch::Tensor MoeLayerImpl::ReplicatedWeight(const torch::Tensor& weight) const {
  // Under sequence parallelism the engine sums the replicated parameters' gradients over tp.
  return tp_.sequence_parallel ? weight : SumGradientOverTensorParallel(weight, tp_);
}

MoeRouting MoeLayerImpl::Route(const torch::Tensor& tokens) const {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) == options_.hidden_size,
              "MoE router: tokens must be [T, ", options_.hidden_size, "], got ", tokens.sizes());
  const torch::Tensor logits = at::linear(tokens, ReplicatedWeight(router_weight_));
  MoeRouting routing;
  // As HF: softmax in (at least) float32 over all experts, then the top k of the probabilities.
  routing.probs = at::softmax(logits, -1, at::promote_types(logits.scalar_type(), at::kFloat));
  auto [top_probs, indices] = routing.probs.topk(options_.top_k, /*dim=*/-1);
  if (options_.norm_topk_prob) top_probs = top_probs / top_probs.sum(-1, /*keepdim=*/true);
  routing.indices = indices;
  routing.weights = top_probs.to(tokens.scalar_type());
  return routing;
}

torch::Tensor MoeLayerImpl::GroupedExperts(const torch::Tensor& rows,
                                           const std::vector<int64_t>& sizes,
                                           const torch::Tensor& gate, const torch::Tensor& up,
                                           const torch::Tensor& down) const {
  const std::vector<torch::Tensor> groups = rows.split_with_sizes(sizes);
  const MoeExpertLora lora = ForTensorParallelForward(expert_lora_, tp_);
  std::vector<torch::Tensor> outputs;
  outputs.reserve(groups.size());
  for (size_t e = 0; e < groups.size(); ++e) {
    if (sizes[e] == 0) continue;  // its weights get a zero gradient through the others' slices
    const auto i = static_cast<int64_t>(e);
    outputs.push_back(expert_lora_.enabled() || expert_lora_.nf4()
                          ? ExpertSwiGluWithLora(groups[e], i, gate, up, down, lora,
                                                 is_training())
                          : SwiGlu(groups[e], gate[i], up[i], down[i]));
  }
  // No rows at all (an ep rank whose experts no token chose): an empty product still ties the
  // weights into the graph, so that their gradient is a defined zero like the other ranks'.
  if (outputs.empty()) {
    return expert_lora_.enabled() || expert_lora_.nf4()
               ? ExpertSwiGluWithLora(rows, 0, gate, up, down, lora, is_training())
               : SwiGlu(rows, gate[0], up[0], down[0]);
  }
  return torch::cat(outputs);
}

torch::Tensor MoeLayerImpl::DispatchToExperts(const torch::Tensor& slot_rows,
                                              const std::vector<int64_t>& sizes) const {
  if (!ep_.enabled()) {
    return GroupedExperts(slot_rows, sizes, expert_gate_, expert_up_, expert_down_);
  }
  const int64_t local = ep_.LocalExperts(options_.num_experts);
  // Slots sorted by global expert are already in destination-rank order.
  std::vector<int64_t> send_rows(ep_.size, 0);
  for (int64_t e = 0; e < options_.num_experts; ++e) send_rows[e / local] += sizes[e];
  // The counts travel on the rows' device (NCCL exchanges device tensors only).
  const torch::Tensor recv_counts =
      ExchangeExpertCounts(torch::tensor(sizes, torch::kInt64).to(slot_rows.device()), ep_)
          .to(torch::kCPU)
          .contiguous();
  const int64_t* from = recv_counts.data_ptr<int64_t>();  // [source rank][local expert]
  std::vector<int64_t> recv_rows(ep_.size, 0), local_sizes(local, 0);
  for (int s = 0; s < ep_.size; ++s) {
    for (int64_t l = 0; l < local; ++l) {
      recv_rows[s] += from[s * local + l];
      local_sizes[l] += from[s * local + l];
    }
  }
  // The received rows run by source rank, then local expert: regroup them by local expert (each
  // source's rows in source order) for the grouped products, and back afterwards.
  std::vector<int64_t> group_order;
  group_order.reserve(
      static_cast<size_t>(std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0})));
  std::vector<int64_t> chunk_begin(static_cast<size_t>(ep_.size * local));
  for (int64_t begin = 0, i = 0; i < ep_.size * local; ++i) {
    chunk_begin[i] = begin;
    begin += from[i];
  }
  for (int64_t l = 0; l < local; ++l) {
    for (int s = 0; s < ep_.size; ++s) {
      const int64_t chunk = s * local + l;
      for (int64_t r = 0; r < from[chunk]; ++r) group_order.push_back(chunk_begin[chunk] + r);
    }
  }
  const torch::Tensor order = torch::tensor(group_order, torch::kInt64).to(slot_rows.device());
  const torch::Tensor received = ExchangeRows(slot_rows, send_rows, recv_rows, ep_);
  const torch::Tensor computed = GroupedExperts(received.index_select(0, order), local_sizes,
                                                expert_gate_, expert_up_, expert_down_);
  const torch::Tensor unordered = torch::zeros_like(computed).index_copy(0, order, computed);
  return ExchangeRows(unordered, recv_rows, send_rows, ep_);
}

torch::Tensor MoeLayerImpl::RoutedExperts(const torch::Tensor& tokens, const MoeRouting& routing,
                                          const torch::Tensor& counts) const {
  const int64_t k = options_.top_k;
  // Slot s = t * k + j is token t's j-th choice. A stable sort by expert groups the slots by
  // expert and keeps each group in token order.
  const torch::Tensor slot_experts = routing.indices.reshape(-1);
  const torch::Tensor order =
      std::get<1>(slot_experts.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  const torch::Tensor slot_tokens = at::div(order, k, /*rounding_mode=*/"floor");
  const torch::Tensor slot_weights = routing.weights.reshape(-1).index_select(0, order);

  const torch::Tensor host_counts = counts.to(torch::kCPU);
  const std::vector<int64_t> sizes(host_counts.data_ptr<int64_t>(),
                                   host_counts.data_ptr<int64_t>() + host_counts.numel());
  const torch::Tensor slot_outputs =
      DispatchToExperts(tokens.index_select(0, slot_tokens), sizes) * slot_weights.unsqueeze(1);
  return torch::zeros_like(tokens).index_add(0, slot_tokens, slot_outputs);
}

void MoeLayerImpl::AddLora(int rank, double scale, double dropout,
                           const std::set<std::string>& targets) {
  MoeExpertLora lora = AttachMoeExpertLora(*named_children()["experts"], expert_gate_, expert_up_,
                                           expert_down_, rank, scale, dropout, targets);
  // The NF4 base QuantizeExpertsNf4 made stays.
  lora.gate_nf4 = std::move(expert_lora_.gate_nf4);
  lora.up_nf4 = std::move(expert_lora_.up_nf4);
  lora.down_nf4 = std::move(expert_lora_.down_nf4);
  expert_lora_ = std::move(lora);
}

void MoeLayerImpl::QuantizeExpertsNf4(const std::string& projection, const torch::Tensor& value) {
  torch::Tensor* weight = projection == "gate" ? &expert_gate_
                          : projection == "up" ? &expert_up_
                          : projection == "down" ? &expert_down_
                                                 : nullptr;
  TORCH_CHECK(weight != nullptr, "no expert projection '", projection, "'");
  TORCH_CHECK(value.sizes() == weight->sizes(), "NF4 value ", value.sizes(), " for experts.",
              projection, " of ", weight->sizes());
  // A module cannot drop a parameter, so "experts" is rebuilt without this one: the same
  // tensors and children otherwise, plus a child holding the projection's NF4 state.
  std::shared_ptr<torch::nn::Module> old = named_children()["experts"];
  auto experts = std::make_shared<torch::nn::Module>();
  for (const auto& item : old->named_parameters(/*recurse=*/false)) {
    if (item.key() != projection) {
      experts->register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
  }
  for (const auto& child : old->named_children()) {
    experts->register_module(child.key(), child.value());
  }
  auto holder = experts->register_module(projection, std::make_shared<torch::nn::Module>());
  StackedNf4Weight nf4 = QuantizeStackedNf4(*holder, value);
  replace_module("experts", experts);
  // The float weight leaves the module; a meta tensor keeps its shape for the adapters.
  *weight =
      torch::empty(weight->sizes(), torch::TensorOptions(torch::kFloat32).device(torch::kMeta));
  (projection == "gate" ? expert_lora_.gate_nf4
   : projection == "up" ? expert_lora_.up_nf4
                        : expert_lora_.down_nf4) = std::move(nf4);
}

torch::Tensor MoeLayerImpl::SharedExperts(const torch::Tensor& tokens) const {
  torch::Tensor out = SwiGlu(tokens, shared_gate_, shared_up_, shared_down_);
  if (shared_sigmoid_gate_.defined()) {
    out = at::sigmoid(at::linear(tokens, ReplicatedWeight(shared_sigmoid_gate_))) * out;
  }
  return out;
}

MoeOutput MoeLayerImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == options_.hidden_size,
              "MoE layer: x must be [..., ", options_.hidden_size, "], got ", input.sizes());
  // Under sequence parallelism the whole sequence, so that routing sees every token.
  const torch::Tensor x = EnterTensorParallel(input, tp_);
  const torch::Tensor tokens = x.reshape({-1, options_.hidden_size});
  const int64_t num_tokens = tokens.size(0);
  TORCH_CHECK(num_tokens > 0, "MoE layer: x has no tokens");
  const MoeRouting routing = Route(tokens);

  MoeOutput out;
  out.expert_indices = routing.indices;
  out.tokens_per_expert =
      torch::bincount(routing.indices.reshape(-1), /*weights=*/{}, options_.num_experts);
  // With tp, this rank's partial sum over its slice of every expert (and of the shared expert).
  torch::Tensor y = RoutedExperts(tokens, routing, out.tokens_per_expert);
  if (shared_gate_.defined()) y = y + SharedExperts(tokens);
  out.output = ExitTensorParallel(y.reshape(x.sizes()), tp_);

  out.router_prob_mean = ScaleGradient(routing.probs.mean(0), 1.0 / tp_.size);
  const torch::Tensor token_fraction =
      out.tokens_per_expert.to(routing.probs.scalar_type()) / static_cast<double>(num_tokens);
  // Over the ep group both are means of equal-sized ranks' values: those of the union.
  out.aux_loss =
      (MeanOverExperts(token_fraction, ep_) * MeanOverExperts(out.router_prob_mean, ep_)).sum() *
      static_cast<double>(options_.num_experts);
  out.weighted_aux_loss = out.aux_loss * options_.aux_loss_coef;
  return out;
}

torch::Tensor AttachAuxLoss(const torch::Tensor& x, const torch::Tensor& aux,
                            const AuxLossScale* scale) {
  TORCH_CHECK(aux.dim() == 0, "the router loss must be a scalar, got ", aux.sizes());
  TORCH_CHECK(scale != nullptr, "AttachAuxLoss needs a scale");
  return AttachAuxLossFunction::apply(x, aux, reinterpret_cast<int64_t>(scale));
}

std::string HfMoeBlockName(HfMoeFamily family) {
  return family == HfMoeFamily::kMixtral ? "block_sparse_moe" : "mlp";
}

absl::StatusOr<std::vector<HfMoeTensor>> HfMoeParameterNames(const MoeOptions& options,
                                                             HfMoeFamily family) {
  if (absl::Status valid = ValidateMoeOptions(options); !valid.ok()) return valid;
  const bool mixtral = family == HfMoeFamily::kMixtral;
  if (options.num_shared_experts > 0) {
    if (mixtral) {
      return absl::InvalidArgumentError(
          "moe.num_shared_experts: Mixtral checkpoints have no shared experts");
    }
    if (options.num_shared_experts != 1 || !options.shared_expert_gate) {
      return absl::InvalidArgumentError(
          "moe.num_shared_experts: Qwen2-MoE checkpoints hold exactly one shared expert, gated "
          "(shared_expert_gate)");
    }
  }
  auto per_expert = [&](const char* projection) {
    std::vector<std::string> names;
    names.reserve(options.num_experts);
    for (int64_t e = 0; e < options.num_experts; ++e) {
      names.push_back(absl::StrCat("experts.", e, ".", projection, ".weight"));
    }
    return names;
  };
  std::vector<HfMoeTensor> tensors = {
      {"router.weight", {"gate.weight"}},
      {"experts.gate", per_expert(mixtral ? "w1" : "gate_proj"), /*stacked=*/true},
      {"experts.up", per_expert(mixtral ? "w3" : "up_proj"), /*stacked=*/true},
      {"experts.down", per_expert(mixtral ? "w2" : "down_proj"), /*stacked=*/true},
  };
  if (options.num_shared_experts > 0) {
    tensors.push_back({"shared.gate", {"shared_expert.gate_proj.weight"}});
    tensors.push_back({"shared.up", {"shared_expert.up_proj.weight"}});
    tensors.push_back({"shared.down", {"shared_expert.down_proj.weight"}});
    tensors.push_back({"shared.sigmoid_gate", {"shared_expert_gate.weight"}});
  }
  return tensors;
}

}  // namespace tessera::trainer
