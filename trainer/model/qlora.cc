#include "trainer/model/qlora.h"

#include <ATen/autocast_mode.h>

#include <array>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

constexpr char kNf4Infix[] = ".weight_nf4_";

// The linear layers of a block, as "<module>.<child>.weight" after "layers.N." (GPT-2's and
// Llama's names; both MLPs' output is "mlp.proj" or "mlp.down").
constexpr std::array<const char*, 11> kBlockLinearWeights = {
    "attn.qkv.weight", "attn.q.weight",  "attn.k.weight",  "attn.v.weight",
    "attn.o.weight",   "attn.proj.weight", "mlp.gate.weight", "mlp.up.weight",
    "mlp.down.weight", "mlp.fc.weight",  "mlp.proj.weight"};

}  // namespace

bool IsNf4Parameter(const std::string& name) { return absl::StrContains(name, kNf4Infix); }

bool IsNf4QuantizedWeight(const std::string& name) {
  absl::string_view rest = name;
  if (!absl::ConsumePrefix(&rest, "layers.")) return false;
  const size_t dot = rest.find('.');
  int layer = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dot), &layer)) {
    return false;
  }
  rest.remove_prefix(dot + 1);
  for (const char* weight : kBlockLinearWeights) {
    if (rest == weight) return true;
  }
  return false;
}

void DenseImpl::QuantizeWeightNf4(const torch::Tensor& value) {
  TORCH_CHECK(!is_nf4(), "the weight is already in NF4");
  TORCH_CHECK(value.sizes() == weight.sizes(), "NF4 weight value ", value.sizes(),
              " for a weight of ", weight.sizes());
  absl::StatusOr<Nf4Tensor> quantized = QuantizeNf4(value);
  TORCH_CHECK(quantized.ok(), quantized.status().ToString());
  // The float32 weight leaves the module; a meta tensor keeps its shape for the LoRA adapters.
  parameters_.erase("weight");
  weight = torch::empty(weight.sizes(), torch::TensorOptions(torch::kFloat32).device(torch::kMeta));
  quantized->codes = register_parameter("weight_nf4_codes", quantized->codes, false);
  quantized->absmax_codes =
      register_parameter("weight_nf4_absmax_codes", quantized->absmax_codes, false);
  quantized->absmax_scales =
      register_parameter("weight_nf4_absmax_scales", quantized->absmax_scales, false);
  quantized->absmax_offset =
      register_parameter("weight_nf4_absmax_offset", quantized->absmax_offset, false);
  nf4_ = *std::move(quantized);
}

namespace {

// x in the dtype at::linear would compute in: autocast's where it is on. The custom autograd
// function is below autocast, so it is cast here.
torch::Tensor InComputeDtype(const torch::Tensor& x) {
  const at::DeviceType device = x.device().type();
  at::ScalarType dtype = x.scalar_type();
  if ((device == at::kCUDA || device == at::kCPU) && at::autocast::is_autocast_enabled(device)) {
    dtype = at::autocast::get_autocast_dtype(device);
  }
  return x.to(dtype);
}

}  // namespace

torch::Tensor DenseImpl::Nf4Forward(const torch::Tensor& x) {
  return Nf4LinearForward(InComputeDtype(x), *nf4_, bias);
}

torch::Tensor Nf4ProductWithoutBias(DenseImpl& linear, const torch::Tensor& x) {
  TORCH_CHECK(linear.is_nf4(), "the linear layer's weight is not in NF4");
  return Nf4LinearForward(InComputeDtype(x), *linear.nf4_weight(), torch::Tensor());
}

absl::Status MaterializeNf4Base(CausalLMImpl& model, const ParameterValues& values) {
  if (model.storage() != ParameterStorage::kDeferred) {
    return absl::FailedPreconditionError("an NF4 base is built from a kDeferred model");
  }
  try {
    torch::NoGradGuard no_grad;
    std::map<std::string, std::shared_ptr<DenseImpl>> dense;
    std::map<std::string, std::shared_ptr<MoeLayerImpl>> moe;
    for (const auto& item : model.named_modules()) {
      if (auto linear = std::dynamic_pointer_cast<DenseImpl>(item.value())) {
        dense.emplace(item.key(), std::move(linear));
      } else if (auto layer = std::dynamic_pointer_cast<MoeLayerImpl>(item.value())) {
        moe.emplace(item.key(), std::move(layer));
      }
    }
    // A copy of the list: quantizing replaces parameters.
    const auto params = model.named_parameters();
    for (const auto& item : params) {
      const std::string& name = item.key();
      ASSIGN_OR_RETURN(torch::Tensor value, values(name));
      if (IsExpertParameter(name)) {
        // "layers.N.mlp.experts.gate": this rank's experts of the layer "layers.N.mlp", each
        // quantized on its own.
        const size_t experts = name.rfind(".experts.");
        auto it = moe.find(name.substr(0, experts));
        if (it == moe.end()) return absl::InternalError(absl::StrCat("no MoE layer of ", name));
        it->second->QuantizeExpertsNf4(name.substr(experts + std::string(".experts.").size()),
                                       value.to(torch::kCPU, torch::kFloat32));
        continue;
      }
      if (IsNf4QuantizedWeight(name)) {
        auto it = dense.find(name.substr(0, name.size() - std::string(".weight").size()));
        if (it == dense.end()) return absl::InternalError(absl::StrCat("no linear layer of ", name));
        it->second->QuantizeWeightNf4(value.to(torch::kCPU));
        continue;
      }
      // The parameter keeps its identity (the modules' references to it) and takes the value's
      // storage: set_data refuses to turn a meta tensor into a dense one.
      const torch::Tensor data = value.to(torch::kCPU, torch::kFloat32).contiguous().clone();
      torch::Tensor param = item.value();
      param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
    }
    model.SetMaterialized();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("building the NF4 base: LibTorch: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

int64_t Nf4BaseBytes(CausalLMImpl& model) {
  int64_t bytes = 0;
  for (const auto& item : model.named_parameters()) {
    if (IsNf4Parameter(item.key())) bytes += static_cast<int64_t>(item.value().nbytes());
  }
  return bytes;
}

}  // namespace tessera::trainer
