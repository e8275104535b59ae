#include "trainer/model/moe_lora.h"

#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/model/lora.h"
#include "trainer/parallel/collective_timer.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

// `experts`' child module `name`: the one holding the projection's NF4 state, or a new one.
std::shared_ptr<torch::nn::Module> ChildOf(torch::nn::Module& experts, const std::string& name) {
  for (const auto& child : experts.named_children()) {
    if (child.key() == name) return child.value();
  }
  return experts.register_module(name, std::make_shared<torch::nn::Module>());
}

StackedLoraAdapter Attach(torch::nn::Module& experts, const std::string& name,
                          const torch::Tensor& weight, int rank) {
  // Sized from the stacked weight: an expert-parallel rank holds only its slice of the experts.
  const int64_t num_experts = weight.size(0), out = weight.size(1), in = weight.size(2);
  auto holder = ChildOf(experts, name);
  // A weight in NF4 is a meta tensor of its shape: its adapters train in float32, as a dense
  // layer's under QLoRA.
  const torch::TensorOptions options =
      (weight.is_meta() ? torch::TensorOptions(torch::kFloat32) : weight.options())
          .requires_grad(false);
  StackedLoraAdapter adapter;
  adapter.a = holder->register_parameter("lora_a", torch::zeros({num_experts, rank, in}, options));
  adapter.b = holder->register_parameter("lora_b", torch::zeros({num_experts, out, rank}, options));
  return adapter;
}

// Expert e's projection of x [n, in] through `weight`[e] (or its NF4 state) plus its adapter,
// if any.
torch::Tensor Project(const torch::Tensor& x, int64_t e, const torch::Tensor& weight,
                      const StackedNf4Weight& nf4, const StackedLoraAdapter& adapter,
                      const MoeExpertLora& lora, bool training) {
  torch::Tensor y = nf4.defined() ? Nf4LinearForward(x, nf4.Expert(e), torch::Tensor())
                                  : at::linear(x, weight[e]);
  if (!adapter.a.defined()) return y;
  const torch::Tensor in =
      lora.dropout > 0 ? F::dropout(x, F::DropoutFuncOptions().p(lora.dropout).training(training))
                       : x;
  return y + at::linear(at::linear(in, adapter.a[e]), adapter.b[e]) * lora.scale;
}

}  // namespace

bool IsExpertLoraParameter(const std::string& name) {
  for (const char* matrix : {".lora_a", ".lora_b"}) {
    if (!absl::EndsWith(name, matrix)) continue;
    return IsExpertParameter(name.substr(0, name.size() - std::string(matrix).size()));
  }
  return false;
}

bool IsExpertShardedParameter(const std::string& name) {
  return IsExpertParameter(name) || IsExpertLoraParameter(name);
}

torch::Tensor GatherExpertShards(const torch::Tensor& local, const ExpertParallel& ep) {
  if (!ep.enabled()) return local;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> input{local.detach().contiguous()};
  std::vector<std::vector<torch::Tensor>> output(1);
  for (int r = 0; r < ep.size; ++r) output[0].push_back(torch::empty_like(input[0]));
  // Outside any step (the final export): timed for the totals, waited for at once.
  const CollectiveIssue issue = IssueCollective(CollectiveKind::kAllGather, ep.group.get(),
                                                TensorBytes(input) * ep.size, local.is_cuda());
  ep.group->allgather(output, input)->wait();
  RecordCollective(issue);
  return torch::cat(output[0]);
}

MoeExpertLora AttachMoeExpertLora(torch::nn::Module& experts, const torch::Tensor& gate,
                                  const torch::Tensor& up, const torch::Tensor& down, int rank,
                                  double scale, double dropout,
                                  const std::set<std::string>& targets) {
  MoeExpertLora lora{.scale = scale, .dropout = dropout};
  for (const std::string& target : targets) {
    if (!absl::StartsWith(target, "mlp.")) continue;
    TORCH_CHECK(target == kMoeLoraGate || target == kMoeLoraUp || target == kMoeLoraDown,
                "LoRA target ", target, ": a mixture-of-experts layer adapts only its experts (",
                kMoeLoraGate, ", ", kMoeLoraUp, ", ", kMoeLoraDown, ")");
  }
  if (targets.contains(kMoeLoraGate)) lora.gate = Attach(experts, "gate", gate, rank);
  if (targets.contains(kMoeLoraUp)) lora.up = Attach(experts, "up", up, rank);
  if (targets.contains(kMoeLoraDown)) lora.down = Attach(experts, "down", down, rank);
  return lora;
}

MoeExpertLora ForTensorParallelForward(const MoeExpertLora& lora, const TensorParallel& tp) {
  if (!tp.enabled() || tp.sequence_parallel) return lora;
  MoeExpertLora view = lora;
  // Column-parallel gate and up: A replicated, B split by output rows. Row-parallel down: A split
  // by input columns, B replicated; its partial products join the layer's partial output.
  for (StackedLoraAdapter* column : {&view.gate, &view.up}) {
    if (column->a.defined()) column->a = PartialGradientOverTensorParallel(column->a, tp);
  }
  if (view.down.b.defined()) view.down.b = PartialGradientOverTensorParallel(view.down.b, tp);
  return view;
}

torch::Tensor ExpertSwiGluWithLora(const torch::Tensor& x, int64_t e, const torch::Tensor& gate,
                                   const torch::Tensor& up, const torch::Tensor& down,
                                   const MoeExpertLora& lora, bool training) {
  const torch::Tensor hidden =
      FusedSwiGlu(Project(x, e, gate, lora.gate_nf4, lora.gate, lora, training),
                  Project(x, e, up, lora.up_nf4, lora.up, lora, training));
  return Project(hidden, e, down, lora.down_nf4, lora.down, lora, training);
}

Nf4Tensor StackedNf4Weight::Expert(int64_t e) const {
  Nf4Tensor tensor;
  tensor.codes = codes[e];
  tensor.absmax_codes = absmax_codes[e];
  tensor.absmax_scales = absmax_scales[e];
  tensor.absmax_offset = absmax_offset[e];
  tensor.shape = shape;
  return tensor;
}

StackedNf4Weight QuantizeStackedNf4(torch::nn::Module& holder, const torch::Tensor& value) {
  TORCH_CHECK(value.dim() == 3, "a stacked expert weight is [experts, out, in], got ",
              value.sizes());
  std::vector<torch::Tensor> codes, absmax_codes, absmax_scales, absmax_offsets;
  for (int64_t e = 0; e < value.size(0); ++e) {
    absl::StatusOr<Nf4Tensor> quantized = QuantizeNf4(value[e]);
    TORCH_CHECK(quantized.ok(), "expert ", e, ": ", quantized.status().ToString());
    codes.push_back(quantized->codes);
    absmax_codes.push_back(quantized->absmax_codes);
    absmax_scales.push_back(quantized->absmax_scales);
    absmax_offsets.push_back(quantized->absmax_offset);
  }
  StackedNf4Weight stacked;
  stacked.shape = {value.size(1), value.size(2)};
  stacked.codes = holder.register_parameter("weight_nf4_codes", torch::stack(codes), false);
  stacked.absmax_codes =
      holder.register_parameter("weight_nf4_absmax_codes", torch::stack(absmax_codes), false);
  stacked.absmax_scales =
      holder.register_parameter("weight_nf4_absmax_scales", torch::stack(absmax_scales), false);
  stacked.absmax_offset =
      holder.register_parameter("weight_nf4_absmax_offset", torch::stack(absmax_offsets), false);
  return stacked;
}

}  // namespace tessera::trainer
