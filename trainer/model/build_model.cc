#include "trainer/model/build_model.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer/model/hf_weights.h"
#include "trainer/model/qlora.h"

namespace tessera::trainer {

absl::Status FromPretrainedError(const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("model.from_pretrained: ", status.message()));
}

absl::StatusOr<planner::ResolvedLora> ApplyLora(CausalLMImpl& model, const v1::LoraSpec& spec) {
  ASSIGN_OR_RETURN(planner::ResolvedLora lora, planner::ResolveLora(spec, model.dims()));
  model.AddLora(LoraOptionsOf(lora));
  return lora;
}

void HoldFrozenInBf16(CausalLMImpl& model) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    // QLoRA's NF4 state keeps its own types (uint8 codes, float32 scales).
    if (IsNf4Parameter(item.key())) continue;
    torch::Tensor param = item.value();
    if (!param.requires_grad()) param.set_data(param.to(torch::kBFloat16));
  }
}

absl::StatusOr<BuiltModel> BuildModel(const ModelBuildOptions& options) {
  const bool nf4 = options.lora != nullptr &&
                   options.lora->base_quantization() == v1::LORA_BASE_QUANTIZATION_NF4;
  // The spec's errors (INVALID_ARGUMENT naming the field) before anything is built.
  if (nf4) RETURN_IF_ERROR(planner::ResolveLora(*options.lora, options.dims).status());
  torch::manual_seed(options.seed);
  BuiltModel built;
  // QLoRA's base is built deferred and materialized one tensor at a time, straight into NF4.
  built.model = CausalLM(options.dims, options.init_std, options.partition,
                         options.deferred || nf4 ? ParameterStorage::kDeferred
                                                 : ParameterStorage::kInitialized);
  built.initial_values = [model = built.model](const std::string& name) {
    return absl::StatusOr<at::Tensor>(model->InitialValue(name));
  };
  if (nf4) {
    ParameterValues values = built.initial_values;
    if (!options.from_pretrained.empty()) {
      absl::StatusOr<ParameterValues> files =
          HfWeightValues(*built.model, options.from_pretrained);
      if (!files.ok()) return FromPretrainedError(files.status());
      values = *std::move(files);
    }
    absl::Status status = MaterializeNf4Base(*built.model, values);
    if (!status.ok()) {
      return options.from_pretrained.empty() ? status : FromPretrainedError(status);
    }
  } else if (!options.from_pretrained.empty()) {
    // Every rank reads its own part; a resumed checkpoint then overrides these weights.
    absl::Status status;
    if (options.deferred) {
      auto values = HfWeightValues(*built.model, options.from_pretrained);
      status = values.status();
      if (values.ok()) built.initial_values = *std::move(values);
    } else {
      status = LoadHfWeights(*built.model, options.from_pretrained);
    }
    if (!status.ok()) return FromPretrainedError(status);
  }
  if (options.lora != nullptr) {
    ASSIGN_OR_RETURN(built.lora, ApplyLora(*built.model, *options.lora));
  }
  built.model->MoveTo(options.device);
  if (built.lora.has_value() && options.bf16) HoldFrozenInBf16(*built.model);
  built.model->SetActivationCheckpointing(options.checkpointing);
  return built;
}

}  // namespace tessera::trainer
