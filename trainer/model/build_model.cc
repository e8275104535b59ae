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
  BuiltModel built;
  built.lora = options.lora;
  const bool nf4 = built.lora.has_value() && built.lora->base_nf4;
  torch::manual_seed(options.seed);
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
  // The adapters, which freeze the base. Before the move to the device.
  if (built.lora.has_value()) built.model->AddLora(LoraOptionsOf(*built.lora));
  built.model->MoveTo(options.device);
  if (built.lora.has_value() && options.bf16) HoldFrozenInBf16(*built.model);
  built.model->SetActivationCheckpointing(options.checkpointing);
  return built;
}

}  // namespace tessera::trainer
