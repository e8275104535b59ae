#include "trainer/model/build_model.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer/model/hf_weights.h"

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
  for (auto& param : model.parameters()) {
    if (!param.requires_grad()) param.set_data(param.to(torch::kBFloat16));
  }
}

absl::StatusOr<BuiltModel> BuildModel(const ModelBuildOptions& options) {
  torch::manual_seed(options.seed);
  BuiltModel built;
  built.model =
      CausalLM(options.dims, options.init_std, options.partition,
               options.deferred ? ParameterStorage::kDeferred : ParameterStorage::kInitialized);
  built.initial_values = [model = built.model](const std::string& name) {
    return absl::StatusOr<at::Tensor>(model->InitialValue(name));
  };
  if (!options.from_pretrained.empty()) {
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
