#include "trainer/runtime/final_export.h"

#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer/model/hf_weights.h"
#include "trainer/model/lora.h"
#include "trainer/model/moe_lora.h"
#include "trainer/model/qlora.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

// Empties `dir` first, so that files of an earlier export (an adapter where the model now is, or
// the reverse) never mix with this one's.
absl::Status ClearDirectory(const std::string& dir) {
  std::error_code error;
  std::filesystem::remove_all(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot clear: ", error.message()));
  return absl::OkStatus();
}

// The suffix of the first of an NF4 weight's four state tensors (qlora.h).
constexpr char kNf4CodesSuffix[] = ".weight_nf4_codes";

// This rank's part of the float32 weight that the NF4 state under `prefix` holds ("layers.0.attn.q"
// for a dense layer's, "layers.0.mlp.experts.gate" for a stacked expert projection's) and the
// weight's parameter name.
std::pair<std::string, torch::Tensor> DequantizedLocalWeight(
    CausalLMImpl& model, const std::string& prefix,
    const torch::OrderedDict<std::string, torch::Tensor>& params) {
  auto state = [&](const char* suffix) { return params[absl::StrCat(prefix, suffix)]; };
  const bool expert = IsExpertParameter(prefix);
  const std::string weight = expert ? prefix : absl::StrCat(prefix, ".weight");
  std::vector<int64_t> local = LocalShape(model.ShardOf(weight), model.partition().tp.size);
  StackedNf4Weight stacked;
  stacked.codes = state(kNf4CodesSuffix);
  stacked.absmax_codes = state(".weight_nf4_absmax_codes");
  stacked.absmax_scales = state(".weight_nf4_absmax_scales");
  stacked.absmax_offset = state(".weight_nf4_absmax_offset");
  if (!expert) {
    Nf4Tensor dense;
    dense.codes = stacked.codes;
    dense.absmax_codes = stacked.absmax_codes;
    dense.absmax_scales = stacked.absmax_scales;
    dense.absmax_offset = stacked.absmax_offset;
    dense.shape = local;
    return {weight, DequantizeNf4(dense)};
  }
  // One expert's [out, in] of this rank's experts.
  stacked.shape = {local[1], local[2]};
  std::vector<torch::Tensor> experts;
  for (int64_t e = 0; e < stacked.codes.size(0); ++e) {
    experts.push_back(DequantizeNf4(stacked.Expert(e)));
  }
  return {weight, torch::stack(experts)};
}

}  // namespace

absl::StatusOr<CausalLM> GatherMergedExportModel(const v1::JobSpec& spec, CausalLMImpl& model,
                                                 const LoraAdapterValues& adapters, bool keep) {
  const ModelPartition& partition = model.partition();
  if (spec.checkpoint().export_format() != v1::EXPORT_FORMAT_HF || !spec.has_lora() ||
      !spec.checkpoint().export_merged() || (!partition.tp.enabled() && !partition.ep.enabled())) {
    return CausalLM(nullptr);
  }
  std::map<std::string, torch::Tensor> values;
  try {
    torch::NoGradGuard no_grad;
    const auto params = model.named_parameters();
    // named_parameters' order is the same on every rank, so the tp and ep ranks gather alike.
    for (const auto& item : params) {
      const std::string& name = item.key();
      if (IsLoraParameter(name)) continue;  // gathered already
      std::string weight = name;
      torch::Tensor local = item.value();
      if (IsNf4Parameter(name)) {
        if (!absl::EndsWith(name, kNf4CodesSuffix)) continue;
        std::tie(weight, local) = DequantizedLocalWeight(
            model, name.substr(0, name.size() - std::string(kNf4CodesSuffix).size()), params);
      }
      torch::Tensor whole =
          GatherWholeTensor(weight, local, model.ShardOf(weight), partition.tp, partition.ep);
      if (keep) values.emplace(weight, std::move(whole));
    }
    if (!keep) return CausalLM(nullptr);
    CausalLM merged(model.dims(), spec.model().init_std());
    merged->AddLora(model.lora());
    for (const auto& item : merged->named_parameters()) {
      auto it = values.find(item.key());
      const torch::Tensor* value = nullptr;
      if (it != values.end()) value = &it->second;
      if (auto adapter = adapters.find(item.key()); adapter != adapters.end()) {
        value = &adapter->second;
      }
      if (value == nullptr || value->sizes() != item.value().sizes()) {
        return absl::InternalError(
            absl::StrCat("merged export: no whole value of '", item.key(), "' was gathered"));
      }
      item.value().copy_(*value);
    }
    return merged;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("merged export: gathering the model: LibTorch: ", e.what_without_backtrace()));
  }
}

bool FinalExportNeedsTesseraFile(const v1::JobSpec& spec) {
  const v1::ExportFormat format = spec.checkpoint().export_format();
  return spec.checkpoint().export_safetensors() || format == v1::EXPORT_FORMAT_TESSERA ||
         (format == v1::EXPORT_FORMAT_HF && !spec.has_lora());
}

absl::StatusOr<std::vector<std::string>> WriteFinalHfExport(const FinalExportInputs& inputs) {
  const v1::JobSpec& spec = inputs.task->spec();
  std::vector<std::string> written;
  if (spec.checkpoint().export_format() != v1::EXPORT_FORMAT_HF) return written;
  const std::string& source = spec.model().from_pretrained();
  const std::string dir = absl::StrCat(inputs.task->checkpoint_directory(), "/", kHfExportDir);
  RETURN_IF_ERROR(ClearDirectory(dir));
  try {
    if (inputs.lora != nullptr) {
      RETURN_IF_ERROR(
          ExportPeftAdapter(*inputs.model, *inputs.lora, dir, source, inputs.lora_adapters));
      RETURN_IF_ERROR(CopyHfSourceFiles(source, dir));
      written.push_back(dir);
      if (spec.checkpoint().export_merged()) {
        const std::string merged =
            absl::StrCat(inputs.task->checkpoint_directory(), "/", kHfMergedExportDir);
        RETURN_IF_ERROR(ClearDirectory(merged));
        CausalLMImpl& whole = inputs.merged_model != nullptr ? *inputs.merged_model : *inputs.model;
        RETURN_IF_ERROR(ExportHfModel(whole, merged, source));
        written.push_back(merged);
      }
      return written;
    }
    // The whole model on the CPU from the checkpoint's export, whatever this rank holds.
    CausalLM whole(inputs.summary->dims(), spec.model().init_std());
    RETURN_IF_ERROR(
        LoadTesseraWeights(*whole, absl::StrCat(inputs.checkpoint_path, "/model.safetensors")));
    RETURN_IF_ERROR(ExportHfModel(*whole, dir, source));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("checkpoint.export_format EXPORT_FORMAT_HF: LibTorch: ",
                                            e.what_without_backtrace()));
  }
  written.push_back(dir);
  return written;
}

}  // namespace tessera::trainer
