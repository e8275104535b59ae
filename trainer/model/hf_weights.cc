#include "trainer/model/hf_weights.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "planner/hf_config.h"
#include "planner/model_config.h"
#include "trainer/io/safetensors.h"
#include "trainer/model/nf4.h"
#include "trainer/model/qlora.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using Json = nlohmann::json;

// A tensor as a Hugging Face file names it; `transposed`: stored [in, out] (GPT-2's Conv1D).
// `stacked`, when not empty: the parameter is torch.stack of these tensors along a new dim 0 (an
// MoE layer's experts), and `name` is the first of them.
struct HfName {
  explicit HfName(std::string name, bool transposed = false)
      : name(std::move(name)), transposed(transposed) {}
  std::string name;
  bool transposed = false;
  std::vector<std::string> stacked;
};

// Per-layer names: Tessera's suffix after "layers.N.", transformers' after its layer prefix.
struct LayerName {
  const char* tessera;
  const char* hf;
  bool transposed;
};

constexpr LayerName kLlamaLayer[] = {
    {"attn_norm.weight", "input_layernorm.weight", false},
    {"attn.q.weight", "self_attn.q_proj.weight", false},
    {"attn.k.weight", "self_attn.k_proj.weight", false},
    {"attn.v.weight", "self_attn.v_proj.weight", false},
    {"attn.o.weight", "self_attn.o_proj.weight", false},
    {"attn.q_norm.weight", "self_attn.q_norm.weight", false},
    {"attn.k_norm.weight", "self_attn.k_norm.weight", false},
    {"mlp_norm.weight", "post_attention_layernorm.weight", false},
    {"mlp.gate.weight", "mlp.gate_proj.weight", false},
    {"mlp.up.weight", "mlp.up_proj.weight", false},
    {"mlp.down.weight", "mlp.down_proj.weight", false},
};

constexpr LayerName kGpt2Layer[] = {
    {"attn_norm.weight", "ln_1.weight", false},       {"attn_norm.bias", "ln_1.bias", false},
    {"attn.qkv.weight", "attn.c_attn.weight", true},  {"attn.qkv.bias", "attn.c_attn.bias", false},
    {"attn.proj.weight", "attn.c_proj.weight", true}, {"attn.proj.bias", "attn.c_proj.bias", false},
    {"mlp_norm.weight", "ln_2.weight", false},        {"mlp_norm.bias", "ln_2.bias", false},
    {"mlp.fc.weight", "mlp.c_fc.weight", true},       {"mlp.fc.bias", "mlp.c_fc.bias", false},
    {"mlp.proj.weight", "mlp.c_proj.weight", true},   {"mlp.proj.bias", "mlp.c_proj.bias", false},
};

// A per-layer parameter name "layers.<layer>.<rest>" split; nullopt for the others.
struct LayerPart {
  int layer = 0;
  absl::string_view rest;
};
std::optional<LayerPart> SplitLayerName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "layers.")) return std::nullopt;
  const size_t dot = name.find('.');
  LayerPart part;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(name.substr(0, dot), &part.layer)) {
    return std::nullopt;
  }
  part.rest = name.substr(dot + 1);
  return part;
}

// transformers' name of the Tessera parameter `name`; nullopt for one with no counterpart.
std::optional<HfName> HfNameOf(const std::string& name, const v1::ModelDims& dims) {
  const bool gpt2 = dims.architecture() == v1::ARCHITECTURE_GPT2;
  static const std::map<std::string, std::string> kLlamaGlobal = {
      {"embed.weight", "model.embed_tokens.weight"},
      {"final_norm.weight", "model.norm.weight"},
      {"lm_head", "lm_head.weight"}};
  static const std::map<std::string, std::string> kGpt2Global = {
      {"embed.weight", "transformer.wte.weight"},
      {"pos_embed.weight", "transformer.wpe.weight"},
      {"final_norm.weight", "transformer.ln_f.weight"},
      {"final_norm.bias", "transformer.ln_f.bias"},
      {"lm_head", "lm_head.weight"}};
  const auto& globals = gpt2 ? kGpt2Global : kLlamaGlobal;
  if (auto it = globals.find(name); it != globals.end()) return HfName{it->second};
  const std::optional<LayerPart> part = SplitLayerName(name);
  if (!part.has_value()) return std::nullopt;
  const int layer = part->layer;
  const absl::string_view suffix = part->rest;
  auto find = [&](const auto& table, absl::string_view prefix) -> std::optional<HfName> {
    for (const LayerName& entry : table) {
      if (suffix == entry.tessera) {
        return HfName{absl::StrCat(prefix, layer, ".", entry.hf), entry.transposed};
      }
    }
    return std::nullopt;
  };
  if (absl::string_view moe_suffix = suffix;
      dims.num_experts() > 0 && absl::ConsumePrefix(&moe_suffix, "mlp.")) {
    // The mixture-of-experts block: Qwen3-MoE's when the model has qk_norm, else Mixtral's
    // (planner::HfArchitectureOf).
    const HfMoeFamily family = dims.qk_norm() ? HfMoeFamily::kQwenMoe : HfMoeFamily::kMixtral;
    auto tensors = HfMoeParameterNames(MoeOptionsOf(dims, planner::kDefaultInitStd), family);
    if (!tensors.ok()) return std::nullopt;
    const std::string prefix =
        absl::StrCat("model.layers.", layer, ".", HfMoeBlockName(family), ".");
    for (const HfMoeTensor& tensor : *tensors) {
      if (moe_suffix != tensor.name) continue;
      HfName hf{absl::StrCat(prefix, tensor.hf_names[0])};
      if (tensor.stacked) {
        for (const std::string& part : tensor.hf_names) hf.stacked.push_back(prefix + part);
      }
      return hf;
    }
    return std::nullopt;
  }
  return gpt2 ? find(kGpt2Layer, "transformer.h.") : find(kLlamaLayer, "model.layers.");
}

absl::Status Invalid(absl::string_view file, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", problem));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Invalid(path, "cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// The safetensors files of a model and the tensors each holds; reads one tensor at a time.
class WeightFiles {
 public:
  // `dir`'s model.safetensors.index.json, else its model.safetensors.
  static absl::StatusOr<WeightFiles> OpenHfDirectory(const std::string& dir) {
    WeightFiles files;
    const std::string index_path = absl::StrCat(dir, "/", kHfWeightsIndexFileName);
    if (std::filesystem::exists(index_path)) {
      ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
      Json index = Json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
          !index["weight_map"].is_object()) {
        return Invalid(index_path, "weight_map: missing or not a JSON object");
      }
      for (const auto& [name, file] : index["weight_map"].items()) {
        if (!file.is_string() || absl::StrContains(file.get<std::string>(), "/")) {
          return Invalid(index_path, absl::StrCat("weight_map: '", name,
                                                  "' must map to a file name in the directory"));
        }
        files.file_of_[name] = absl::StrCat(dir, "/", file.get<std::string>());
      }
      for (const auto& [name, path] : files.file_of_) RETURN_IF_ERROR(files.OpenFile(path));
      for (const auto& [name, path] : files.file_of_) {
        if (!files.headers_.at(path).tensors.contains(name)) {
          return Invalid(path, absl::StrCat("has no tensor '", name, "', which ", index_path,
                                            " places there"));
        }
      }
      return files;
    }
    const std::string path = absl::StrCat(dir, "/", kHfWeightsFileName);
    if (!std::filesystem::exists(path)) {
      return Invalid(dir, absl::StrCat("no ", kHfWeightsFileName, " or ", kHfWeightsIndexFileName,
                                       " (only safetensors weights are read)"));
    }
    RETURN_IF_ERROR(files.OpenFile(path));
    return files;
  }

  static absl::StatusOr<WeightFiles> OpenFileOnly(const std::string& path) {
    WeightFiles files;
    RETURN_IF_ERROR(files.OpenFile(path));
    return files;
  }

  bool Has(const std::string& name) const { return file_of_.contains(name); }

  // Where a missing tensor was looked for, for messages.
  std::string Where() const {
    std::vector<std::string> paths;
    for (const auto& [path, header] : headers_) paths.push_back(path);
    return absl::StrJoin(paths, ", ");
  }

  // The header entry of the tensor `name` (which Has): its dtype and shape.
  const SafetensorsEntry& EntryOf(const std::string& name) const {
    return headers_.at(file_of_.at(name)).tensors.at(name);
  }

  // INVALID_ARGUMENT naming the file unless the tensor `name` (which Has) has a dtype Read reads.
  absl::Status CheckDtype(const std::string& name) const {
    if (DtypeOf(EntryOf(name).dtype).has_value()) return absl::OkStatus();
    return Invalid(file_of_.at(name),
                   absl::StrCat("tensor '", name, "' has dtype ", EntryOf(name).dtype,
                                "; F32, F16, BF16 or F64 weights are read"));
  }

  // The tensor `name` (which Has), whole, as float32 [shape].
  absl::StatusOr<torch::Tensor> Read(const std::string& name) const {
    RETURN_IF_ERROR(CheckDtype(name));
    const std::string& path = file_of_.at(name);
    const SafetensorsFile& header = headers_.at(path);
    const SafetensorsEntry& entry = header.tensors.at(name);
    torch::Tensor raw =
        torch::empty(entry.shape, torch::TensorOptions().dtype(*DtypeOf(entry.dtype)));
    const uint64_t nbytes = entry.end - entry.begin;
    if (nbytes != static_cast<uint64_t>(raw.nbytes())) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "' has ", nbytes,
                                              " bytes for shape ", ShapeString(entry.shape)));
    }
    std::ifstream in(path, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(header.data_offset + entry.begin));
    in.read(static_cast<char*>(raw.data_ptr()), static_cast<std::streamsize>(nbytes));
    if (!in) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", name, "': cannot read its ", nbytes, " bytes"));
    }
    return raw.to(torch::kFloat32);
  }

 private:
  static std::optional<torch::ScalarType> DtypeOf(const std::string& dtype) {
    static const std::map<std::string, torch::ScalarType> kDtypes = {{"F32", torch::kFloat32},
                                                                     {"F16", torch::kFloat16},
                                                                     {"BF16", torch::kBFloat16},
                                                                     {"F64", torch::kFloat64}};
    auto it = kDtypes.find(dtype);
    if (it == kDtypes.end()) return std::nullopt;
    return it->second;
  }

  absl::Status OpenFile(const std::string& path) {
    if (headers_.contains(path)) return absl::OkStatus();
    auto header = ReadSafetensorsHeader(path);
    if (!header.ok()) return header.status();
    for (const auto& [name, entry] : header->tensors) file_of_.emplace(name, path);
    headers_.emplace(path, *std::move(header));
    return absl::OkStatus();
  }

  std::map<std::string, std::string> file_of_;  // tensor name -> file path
  std::map<std::string, SafetensorsFile> headers_;
};

// The values of every parameter `model` holds from the tensor `source_name(parameter)` names in
// `files`: each tensor's presence, shape and dtype are checked here, from the files' headers; a
// call reads its tensor and cuts this rank's tensor-parallel shard of it.
template <typename NameFn>
absl::StatusOr<ParameterValues> ValuesIn(const CausalLMImpl& model, WeightFiles files,
                                         NameFn source_name) {
  // Each parameter's tensor in the files, and how this rank's part is cut from it.
  std::map<std::string, std::pair<HfName, ParamShard>> sources;
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    std::optional<HfName> source = source_name(name);
    if (!source.has_value()) {
      return absl::InternalError(absl::StrCat("parameter '", name, "' has no name in the file"));
    }
    // Checkpoints saved from GPT2Model (the original gpt2 upload) lack the "transformer." prefix.
    if (!files.Has(source->name) && absl::StartsWith(source->name, "transformer.") &&
        files.Has(source->name.substr(12))) {
      source->name = source->name.substr(12);
    }
    if (!files.Has(source->name)) {
      return absl::InvalidArgumentError(absl::StrCat(files.Where(), ": no tensor '", source->name,
                                                     "' (for parameter ", name, ")"));
    }
    std::vector<int64_t> expected = model.ShardOf(name).global_shape;
    if (source->transposed && expected.size() == 2) std::swap(expected[0], expected[1]);
    if (!source->stacked.empty()) {
      // Each expert's tensor is one row of dim 0.
      const std::vector<int64_t> row(expected.begin() + 1, expected.end());
      if (static_cast<int64_t>(source->stacked.size()) != expected[0]) {
        return absl::InternalError(absl::StrCat("parameter '", name, "' stacks ", expected[0],
                                                " tensors, not ", source->stacked.size()));
      }
      for (const std::string& part : source->stacked) {
        if (!files.Has(part)) {
          return absl::InvalidArgumentError(
              absl::StrCat(files.Where(), ": no tensor '", part, "' (for parameter ", name, ")"));
        }
        if (files.EntryOf(part).shape != row) {
          return absl::InvalidArgumentError(
              absl::StrCat(files.Where(), ": tensor '", part, "' has shape ",
                           ShapeString(files.EntryOf(part).shape), ", the model's config needs ",
                           ShapeString(row)));
        }
        RETURN_IF_ERROR(files.CheckDtype(part));
      }
      sources.emplace(name, std::pair(*std::move(source), model.ShardOf(name)));
      continue;
    }
    const std::vector<int64_t>& stored = files.EntryOf(source->name).shape;
    if (stored != expected) {
      return absl::InvalidArgumentError(
          absl::StrCat(files.Where(), ": tensor '", source->name, "' has shape ",
                       ShapeString(stored), ", the model's config needs ", ShapeString(expected),
                       source->transposed ? " (stored [in, out])" : ""));
    }
    RETURN_IF_ERROR(files.CheckDtype(source->name));
    sources.emplace(name, std::pair(*std::move(source), model.ShardOf(name)));
  }
  return ParameterValues(
      [files = std::make_shared<const WeightFiles>(std::move(files)), sources = std::move(sources),
       tp = model.partition().tp,
       ep = model.partition().ep](const std::string& name) -> absl::StatusOr<at::Tensor> {
        auto it = sources.find(name);
        if (it == sources.end()) {
          return absl::InternalError(absl::StrCat("no parameter '", name, "' on this rank"));
        }
        const auto& [source, shard] = it->second;
        try {
          torch::NoGradGuard no_grad;
          torch::Tensor full;
          if (source.stacked.empty()) {
            ASSIGN_OR_RETURN(full, files->Read(source.name));
          } else {
            std::vector<torch::Tensor> parts;
            for (const std::string& part : source.stacked) {
              ASSIGN_OR_RETURN(torch::Tensor value, files->Read(part));
              parts.push_back(std::move(value));
            }
            full = torch::stack(parts);
          }
          if (source.transposed) full = full.t().contiguous();
          if (IsExpertParameter(name)) {
            // This rank's experts of the stacked tensor and its tp slice (expert_parallel.h).
            return LocalExpertShardOf(full, shard, ep, tp);
          }
          return LocalShardOf(full, shard, tp.rank, tp.size);
        } catch (const c10::Error& e) {
          return absl::InternalError(
              absl::StrCat("loading weights: LibTorch: ", e.what_without_backtrace()));
        }
      });
}

// Copies into every parameter `model` holds its value from ValuesIn.
absl::Status CopyValues(CausalLMImpl& model, const absl::StatusOr<ParameterValues>& values) {
  RETURN_IF_ERROR(values.status());
  try {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters()) {
      ASSIGN_OR_RETURN(torch::Tensor value, (*values)(item.key()));
      item.value().copy_(value);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading weights: LibTorch: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  return absl::OkStatus();
}

// Files of a Hugging Face directory that describe the tokenizer and generation, copied as they are.
constexpr const char* kCopiedFiles[] = {"generation_config.json",
                                        "tokenizer.json",
                                        "tokenizer_config.json",
                                        "special_tokens_map.json",
                                        "tokenizer.model",
                                        "vocab.json",
                                        "merges.txt",
                                        "added_tokens.json"};

// Creates `dir` and its parents; INTERNAL naming it when it cannot.
absl::Status MakeDirectory(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", error.message()));
  return absl::OkStatus();
}

// Float32 host copies of tensors and the safetensors views of them, for writing a file.
struct HostTensors {
  std::vector<torch::Tensor> keep;
  std::vector<TensorView> views;

  void Add(const std::string& name, torch::Tensor value) {
    keep.push_back(value.contiguous());
    views.push_back({.name = name,
                     .dtype = "F32",
                     .shape = keep.back().sizes().vec(),
                     .data = keep.back().data_ptr(),
                     .nbytes = static_cast<size_t>(keep.back().nbytes())});
  }
};

// PEFT's name of the adapter tensor `name` ("layers.3.attn.q.lora_a"); nullopt for others. An
// MoE expert projection's stacked adapter ("layers.3.mlp.experts.gate.lora_a", [E, ...]) is
// `stacked`: one PEFT tensor per expert ("...mlp.experts.{e}.gate_proj.lora_A.weight"), for the
// `num_local` experts the parameter holds.
std::optional<HfName> PeftNameOf(const std::string& name, const v1::ModelDims& dims,
                                 int64_t num_local = 0) {
  const std::optional<LayerPart> part = SplitLayerName(name);
  if (!part.has_value()) return std::nullopt;
  const int layer = part->layer;
  absl::string_view module = part->rest;
  const char* matrix = absl::ConsumeSuffix(&module, ".lora_a")   ? "lora_A"
                       : absl::ConsumeSuffix(&module, ".lora_b") ? "lora_B"
                                                                 : nullptr;
  if (matrix == nullptr) return std::nullopt;
  const bool gpt2 = dims.architecture() == v1::ARCHITECTURE_GPT2;
  const std::string prefix =
      absl::StrCat("base_model.model.", gpt2 ? "transformer.h." : "model.layers.", layer, ".");
  for (const planner::LoraTarget& target : planner::LoraCandidates(dims)) {
    if (target.module != module) continue;
    if (target.experts == 1) {
      return HfName{absl::StrCat(prefix, target.hf_module, ".", matrix, ".weight")};
    }
    // "mlp.experts.gate_proj" stands for "mlp.experts.{e}.gate_proj".
    const size_t leaf = target.hf_module.rfind('.');
    HfName hf{""};
    for (int64_t e = 0; e < num_local; ++e) {
      hf.stacked.push_back(absl::StrCat(prefix, target.hf_module.substr(0, leaf + 1), e,
                                        target.hf_module.substr(leaf), ".", matrix, ".weight"));
    }
    if (!hf.stacked.empty()) hf.name = hf.stacked.front();
    return hf;
  }
  return std::nullopt;
}

}  // namespace

LoraOptions LoraOptionsOf(const planner::ResolvedLora& lora) {
  LoraOptions options{.rank = lora.rank, .scale = lora.alpha / lora.rank, .dropout = lora.dropout};
  for (const planner::LoraTarget& target : lora.targets) options.targets.insert(target.module);
  return options;
}

absl::StatusOr<LoraAdapterValues> GatherLoraAdapters(CausalLMImpl& model) {
  LoraAdapterValues values;
  try {
    torch::NoGradGuard no_grad;
    // named_parameters' order is the same on every rank, so the ep ranks gather alike.
    for (const auto& item : model.named_parameters()) {
      if (!IsLoraParameter(item.key())) continue;
      // Whole over tp and, for an expert adapter, over ep (lora.h).
      values.emplace(item.key(),
                     GatherWholeTensor(item.key(), item.value(), model.ShardOf(item.key()),
                                       model.partition().tp, model.partition().ep));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("gathering the LoRA adapters: LibTorch: ", e.what_without_backtrace()));
  }
  return values;
}

absl::Status ExportPeftAdapter(CausalLMImpl& model, const planner::ResolvedLora& lora,
                               const std::string& dir, const std::string& base_model,
                               const LoraAdapterValues* gathered) {
  if (model.lora().rank == 0) {
    return absl::FailedPreconditionError("PEFT export: the model has no LoRA adapters");
  }
  LoraAdapterValues own;
  if (gathered == nullptr) {
    if (model.partition().ep.enabled() || model.partition().tp.enabled()) {
      return absl::FailedPreconditionError(
          "PEFT export: this rank holds only its part of the adapters; pass GatherLoraAdapters'");
    }
    ASSIGN_OR_RETURN(own, GatherLoraAdapters(model));
    gathered = &own;
  }
  RETURN_IF_ERROR(MakeDirectory(dir));
  HostTensors tensors;
  try {
    torch::NoGradGuard no_grad;
    for (const auto& [name, value] : *gathered) {
      std::optional<HfName> peft = PeftNameOf(name, model.dims(), value.size(0));
      if (!peft.has_value()) {
        return absl::InternalError(absl::StrCat("adapter '", name, "' has no PEFT name"));
      }
      if (peft->stacked.empty()) {
        tensors.Add(peft->name, value);
        continue;
      }
      const std::vector<torch::Tensor> experts = value.unbind(0);
      for (size_t e = 0; e < experts.size(); ++e) tensors.Add(peft->stacked[e], experts[e]);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("PEFT export: LibTorch: ", e.what_without_backtrace()));
  }
  RETURN_IF_ERROR(WriteSafetensors(absl::StrCat(dir, "/", kPeftWeightsFileName), tensors.views,
                                   {{"format", "pt"}}));
  const bool gpt2 = model.dims().architecture() == v1::ARCHITECTURE_GPT2;
  Json config = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"base_model_name_or_path", base_model.empty() ? Json() : Json(base_model)},
                 {"r", lora.rank},
                 {"lora_alpha", lora.alpha},
                 {"lora_dropout", lora.dropout},
                 {"target_modules", lora.peft_target_modules},
                 {"bias", "none"},
                 // GPT-2's Conv1D layers store [in, out]; PEFT merges into them transposed.
                 {"fan_in_fan_out", gpt2},
                 {"inference_mode", true},
                 {"init_lora_weights", true},
                 {"use_rslora", false},
                 {"use_dora", false},
                 {"modules_to_save", Json()},
                 {"layers_to_transform", Json()},
                 {"rank_pattern", Json::object()},
                 {"alpha_pattern", Json::object()}};
  return WriteText(absl::StrCat(dir, "/", kPeftConfigFileName), config.dump(2) + "\n");
}

absl::StatusOr<v1::LoraSpec> ReadPeftAdapterConfig(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kPeftConfigFileName);
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file (not a PEFT adapter directory)"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadText(path));
  Json config = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) return Invalid(path, "not a JSON object");
  if (config.value("peft_type", "") != "LORA") {
    return Invalid(path, "peft_type: only LORA adapters are read");
  }
  v1::LoraSpec spec;
  if (!config.contains("r") || !config["r"].is_number_integer()) {
    return Invalid(path, "r: missing or not an integer");
  }
  spec.set_rank(config["r"].get<int>());
  if (config.contains("lora_alpha") && config["lora_alpha"].is_number()) {
    spec.set_alpha(config["lora_alpha"].get<double>());
  }
  if (config.contains("lora_dropout") && config["lora_dropout"].is_number()) {
    spec.set_dropout(config["lora_dropout"].get<double>());
  }
  const Json& targets = config.contains("target_modules") ? config["target_modules"] : Json();
  if (targets.is_string()) {
    spec.add_target_modules(targets.get<std::string>());
  } else if (targets.is_array()) {
    for (const Json& target : targets) {
      if (!target.is_string()) return Invalid(path, "target_modules: not a list of names");
      spec.add_target_modules(target.get<std::string>());
    }
  } else {
    return Invalid(path, "target_modules: missing");
  }
  for (const char* unsupported : {"use_dora", "use_rslora"}) {
    if (config.value(unsupported, false)) {
      return Invalid(path, absl::StrCat(unsupported, ": not supported"));
    }
  }
  return spec;
}

absl::Status LoadPeftAdapterWeights(CausalLMImpl& model, const std::string& dir) {
  ASSIGN_OR_RETURN(WeightFiles files,
                   WeightFiles::OpenFileOnly(absl::StrCat(dir, "/", kPeftWeightsFileName)));
  try {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_parameters()) {
      if (!IsLoraParameter(item.key())) continue;
      // Under expert parallelism an expert adapter holds this rank's rows of every expert's.
      const ExpertParallel& ep = model.partition().ep;
      const bool sharded = ep.enabled() && IsExpertLoraParameter(item.key());
      const int64_t rows = item.value().size(0) * (sharded ? ep.size : 1);
      std::optional<HfName> peft = PeftNameOf(item.key(), model.dims(), rows);
      if (!peft.has_value()) {
        return absl::InternalError(absl::StrCat("adapter '", item.key(), "' has no PEFT name"));
      }
      if (sharded) {
        const int64_t first = ep.FirstExpert(rows), local = ep.LocalExperts(rows);
        peft->stacked = std::vector<std::string>(peft->stacked.begin() + first,
                                                 peft->stacked.begin() + first + local);
      }
      std::vector<std::string> names = peft->stacked;
      if (names.empty()) names.push_back(peft->name);
      std::vector<torch::Tensor> parts;
      for (const std::string& part : names) {
        if (!files.Has(part)) {
          return absl::InvalidArgumentError(absl::StrCat(files.Where(), ": no tensor '", part,
                                                         "' (for adapter ", item.key(), ")"));
        }
        ASSIGN_OR_RETURN(torch::Tensor value, files.Read(part));
        parts.push_back(std::move(value));
      }
      torch::Tensor value = peft->stacked.empty() ? parts.front() : torch::stack(parts);
      // Under tp this rank's part of it (lora.h).
      value = LocalShardOf(value, model.ShardOf(item.key()), model.partition().tp.rank,
                           model.partition().tp.size);
      if (value.sizes() != item.value().sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            files.Where(), ": tensor '", names.front(), "' has shape ",
            ShapeString(value.sizes().vec()), ", the adapter needs ",
            ShapeString(item.value().sizes().vec())));
      }
      item.value().copy_(value);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading the adapter: LibTorch: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ParameterValues> HfWeightValues(const CausalLMImpl& model, const std::string& dir) {
  ASSIGN_OR_RETURN(WeightFiles files, WeightFiles::OpenHfDirectory(dir));
  const v1::ModelDims dims = model.dims();
  return ValuesIn(model, std::move(files),
                  [&](const std::string& name) { return HfNameOf(name, dims); });
}

absl::Status LoadHfWeights(CausalLMImpl& model, const std::string& dir) {
  return CopyValues(model, HfWeightValues(model, dir));
}

absl::Status LoadTesseraWeights(CausalLMImpl& model, const std::string& file) {
  ASSIGN_OR_RETURN(WeightFiles files, WeightFiles::OpenFileOnly(file));
  return CopyValues(model, ValuesIn(model, std::move(files), [](const std::string& name) {
                      return std::optional<HfName>(HfName{name});
                    }));
}

absl::Status CopyHfSourceFiles(const std::string& source_dir, const std::string& dir) {
  if (source_dir.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(MakeDirectory(dir));
  std::error_code error;
  for (const char* file : kCopiedFiles) {
    const std::filesystem::path from = std::filesystem::path(source_dir) / file;
    if (!std::filesystem::exists(from)) continue;
    std::filesystem::copy_file(from, std::filesystem::path(dir) / file,
                               std::filesystem::copy_options::overwrite_existing, error);
    if (error) {
      return absl::InternalError(
          absl::StrCat(from.string(), ": cannot copy to ", dir, ": ", error.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ExportHfModel(CausalLMImpl& model, const std::string& dir,
                           const std::string& source_dir) {
  const ModelPartition& partition = model.partition();
  const v1::ModelDims& dims = model.dims();
  if (partition.tp.enabled() || !partition.embedding || !partition.head ||
      model.num_local_layers() != dims.num_layers()) {
    return absl::FailedPreconditionError(
        "Hugging Face export needs the whole model on one rank (no tensor or pipeline split)");
  }
  std::string base_config;
  if (!source_dir.empty()) {
    ASSIGN_OR_RETURN(base_config,
                     ReadText(absl::StrCat(source_dir, "/", planner::kHfConfigFileName)));
  }
  ASSIGN_OR_RETURN(std::string config, planner::HfConfigJson(dims, base_config));
  RETURN_IF_ERROR(MakeDirectory(dir));

  HostTensors tensors;
  try {
    torch::NoGradGuard no_grad;
    const auto params = model.named_parameters();
    // The weights to export by their Tessera names: the parameters, and (QLoRA) the NF4 base's
    // weights dequantized, which are not parameters of their own.
    std::vector<std::pair<std::string, torch::Tensor>> weights;
    for (const auto& item : params) {
      if (IsLoraParameter(item.key()) || IsNf4Parameter(item.key())) continue;
      weights.emplace_back(item.key(), item.value());
    }
    for (const auto& item : model.named_modules()) {
      const auto* dense = item.value()->as<DenseImpl>();
      if (dense != nullptr && dense->is_nf4()) {
        weights.emplace_back(absl::StrCat(item.key(), ".weight"),
                             DequantizeNf4(*dense->nf4_weight()));
      }
    }
    for (const auto& [key, weight] : weights) {
      std::optional<HfName> hf = HfNameOf(key, dims);
      if (!hf.has_value()) {
        return absl::InternalError(absl::StrCat("parameter '", key, "' has no Hugging Face name"));
      }
      torch::Tensor value = weight.detach().to(torch::kCPU, torch::kFloat32);
      // A layer with an adapter exports W + scale * B A (adapters hang under the linear module,
      // "<layer>.lora_a" beside "<layer>.weight", or under a stacked expert weight "<layer>",
      // where the product is per expert).
      const absl::string_view layer = absl::StripSuffix(key, ".weight");
      const torch::Tensor* a = params.find(absl::StrCat(layer, ".lora_a"));
      const torch::Tensor* b = params.find(absl::StrCat(layer, ".lora_b"));
      if (a != nullptr && b != nullptr) {
        value = value + torch::matmul(b->detach().to(torch::kCPU, torch::kFloat32),
                                      a->detach().to(torch::kCPU, torch::kFloat32)) *
                            model.lora().scale;
      }
      if (!hf->stacked.empty()) {
        // An MoE layer's experts: one HF tensor per expert, expert e at index e of dim 0.
        const std::vector<torch::Tensor> experts = value.unbind(0);
        if (experts.size() != hf->stacked.size()) {
          return absl::InternalError(absl::StrCat("parameter '", key, "' holds ",
                                                  experts.size(), " experts, the config ",
                                                  hf->stacked.size()));
        }
        for (size_t e = 0; e < experts.size(); ++e) tensors.Add(hf->stacked[e], experts[e]);
        continue;
      }
      tensors.Add(hf->name, hf->transposed ? value.t() : value);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("Hugging Face export: LibTorch: ", e.what_without_backtrace()));
  }
  RETURN_IF_ERROR(
      WriteSafetensors(absl::StrCat(dir, "/", kHfWeightsFileName), tensors.views,
                       {{"format", "pt"}}));
  RETURN_IF_ERROR(WriteText(absl::StrCat(dir, "/", planner::kHfConfigFileName), config));
  RETURN_IF_ERROR(CopyHfSourceFiles(source_dir, dir));
  if (!std::filesystem::exists(std::filesystem::path(dir) / "generation_config.json")) {
    RETURN_IF_ERROR(WriteText(absl::StrCat(dir, "/generation_config.json"),
                              "{\n  \"_from_model_config\": true\n}\n"));
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer
