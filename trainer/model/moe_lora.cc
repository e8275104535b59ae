#include "trainer/model/moe_lora.h"

#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "trainer/kernels/fused_ops.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

namespace F = torch::nn::functional;

StackedLoraAdapter Attach(torch::nn::Module& experts, const char* name,
                          const torch::Tensor& weight, int rank) {
  // Sized from the stacked weight: an expert-parallel rank holds only its slice of the experts.
  const int64_t num_experts = weight.size(0), out = weight.size(1), in = weight.size(2);
  auto holder = experts.register_module(name, std::make_shared<torch::nn::Module>());
  const torch::TensorOptions options = weight.options().requires_grad(false);
  StackedLoraAdapter adapter;
  adapter.a = holder->register_parameter("lora_a", torch::zeros({num_experts, rank, in}, options));
  adapter.b = holder->register_parameter("lora_b", torch::zeros({num_experts, out, rank}, options));
  return adapter;
}

// Expert e's projection of x [n, in] through `weight`[e] plus its adapter, if any.
torch::Tensor Project(const torch::Tensor& x, int64_t e, const torch::Tensor& weight,
                      const StackedLoraAdapter& adapter, const MoeExpertLora& lora,
                      bool training) {
  torch::Tensor y = at::linear(x, weight[e]);
  if (!adapter.a.defined()) return y;
  const torch::Tensor in =
      lora.dropout > 0 ? F::dropout(x, F::DropoutFuncOptions().p(lora.dropout).training(training))
                       : x;
  return y + at::linear(at::linear(in, adapter.a[e]), adapter.b[e]) * lora.scale;
}

}  // namespace

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

torch::Tensor ExpertSwiGluWithLora(const torch::Tensor& x, int64_t e, const torch::Tensor& gate,
                                   const torch::Tensor& up, const torch::Tensor& down,
                                   const MoeExpertLora& lora, bool training) {
  const torch::Tensor hidden = FusedSwiGlu(Project(x, e, gate, lora.gate, lora, training),
                                           Project(x, e, up, lora.up, lora, training));
  return Project(hidden, e, down, lora.down, lora, training);
}

}  // namespace tessera::trainer
