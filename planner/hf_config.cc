#include "planner/hf_config.h"

#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace tessera::planner {
namespace {

using Json = nlohmann::json;

// Reads typed fields of one config object; every error names the file and the field.
class ConfigReader {
 public:
  ConfigReader(const Json& json, absl::string_view source) : json_(json), source_(source) {}

  absl::Status Error(absl::string_view field, absl::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", field, ": ", problem));
  }

  bool Has(const char* field) const { return json_.contains(field) && !json_[field].is_null(); }

  // A positive int32; `fallback` when the field is absent or null (nullopt: required).
  absl::StatusOr<int32_t> Int(const char* field, std::optional<int32_t> fallback = {}) const {
    if (!Has(field)) {
      if (fallback.has_value()) return *fallback;
      return Error(field, "missing");
    }
    const Json& value = json_[field];
    if (!value.is_number_integer()) return Error(field, "must be an integer");
    const int64_t number = value.get<int64_t>();
    if (number <= 0 || number > std::numeric_limits<int32_t>::max()) {
      return Error(field, absl::StrCat("must be a positive int32, got ", number));
    }
    return static_cast<int32_t>(number);
  }

  absl::StatusOr<double> Number(const char* field, double fallback) const {
    if (!Has(field)) return fallback;
    const Json& value = json_[field];
    if (!value.is_number()) return Error(field, "must be a number");
    const double number = value.get<double>();
    if (!std::isfinite(number) || number <= 0) {
      return Error(field, absl::StrCat("must be a finite number > 0, got ", number));
    }
    return number;
  }

  absl::StatusOr<bool> Bool(const char* field, bool fallback) const {
    if (!Has(field)) return fallback;
    if (!json_[field].is_boolean()) return Error(field, "must be true or false");
    return json_[field].get<bool>();
  }

  absl::StatusOr<std::string> String(const char* field, const std::string& fallback) const {
    if (!Has(field)) return fallback;
    if (!json_[field].is_string()) return Error(field, "must be a string");
    return json_[field].get<std::string>();
  }

  // A boolean feature Tessera does not implement must be absent or `expected`.
  absl::Status Require(const char* field, bool expected) const {
    auto value = Bool(field, expected);
    if (!value.ok()) return value.status();
    if (*value != expected) {
      return Error(field, absl::StrCat(*value ? "true" : "false", " is not supported"));
    }
    return absl::OkStatus();
  }

  // Stores a field read by Int, Number or Bool into `dims` with `setter`, or returns its error.
  template <typename Value, typename Setter>
  absl::Status Set(v1::ModelDims& dims, Setter setter, absl::StatusOr<Value> value) const {
    if (!value.ok()) return value.status();
    (dims.*setter)(*value);
    return absl::OkStatus();
  }

 private:
  const Json& json_;
  std::string source_;
};

// Llama and Qwen3: RMSNorm, RoPE (plain, unscaled), SwiGLU, grouped-query attention.
absl::StatusOr<v1::ModelDims> LlamaFamilyDims(const ConfigReader& config, bool qwen3) {
  v1::ModelDims dims;
  dims.set_architecture(v1::ARCHITECTURE_LLAMA);
  dims.set_qk_norm(qwen3);
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_hidden_size, config.Int("hidden_size")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_ffn_hidden_size, config.Int("intermediate_size")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_num_layers, config.Int("num_hidden_layers")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_num_attention_heads, config.Int("num_attention_heads")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_num_kv_heads,
                             config.Int("num_key_value_heads", dims.num_attention_heads())));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_head_dim, config.Int("head_dim", 0)));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_vocab_size, config.Int("vocab_size")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_max_seq_len, config.Int("max_position_embeddings")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_norm_eps, config.Number("rms_norm_eps", 1e-6)));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_rope_theta, config.Number("rope_theta", 10000.0)));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_tie_embeddings,
                             config.Bool("tie_word_embeddings", false)));

  std::string act;
  ASSIGN_OR_RETURN(act, config.String("hidden_act", "silu"));
  if (act != "silu")
    return config.Error("hidden_act", absl::StrCat("'", act, "' is not supported (silu only)"));
  RETURN_IF_ERROR(config.Require("attention_bias", false));
  RETURN_IF_ERROR(config.Require("mlp_bias", false));
  if (qwen3) RETURN_IF_ERROR(config.Require("use_sliding_window", false));
  return dims;
}

// The mixture-of-experts fields of Qwen3MoeForCausalLM (MoE in every layer: decoder_sparse_step
// 1, no mlp_only_layers) and MixtralForCausalLM (experts as wide as intermediate_size, top-k
// weights always renormalised), added to LlamaFamilyDims' `dims`.
absl::Status AddMoeDims(const Json& json, const ConfigReader& config, bool mixtral,
                        v1::ModelDims& dims) {
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_num_experts,
                             config.Int(mixtral ? "num_local_experts" : "num_experts")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_num_experts_per_token,
                             config.Int("num_experts_per_tok")));
  if (mixtral) {
    dims.set_moe_intermediate_size(dims.ffn_hidden_size());
    dims.set_norm_topk_prob(true);
    if (config.Has("sliding_window")) {
      return config.Error("sliding_window", "is not supported (null only)");
    }
    if (config.Has("router_jitter_noise") &&
        (!json["router_jitter_noise"].is_number() || json["router_jitter_noise"] != 0)) {
      return config.Error("router_jitter_noise", "is not supported (0 only)");
    }
  } else {
    RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_moe_intermediate_size,
                               config.Int("moe_intermediate_size")));
    RETURN_IF_ERROR(
        config.Set(dims, &v1::ModelDims::set_norm_topk_prob, config.Bool("norm_topk_prob", false)));
    if (config.Int("decoder_sparse_step", 1).value_or(0) != 1) {
      return config.Error("decoder_sparse_step", "must be 1 (experts in every layer)");
    }
    if (config.Has("mlp_only_layers") &&
        (!json["mlp_only_layers"].is_array() || !json["mlp_only_layers"].empty())) {
      return config.Error("mlp_only_layers", "must be empty (experts in every layer)");
    }
  }
  if (config.Has("router_aux_loss_coef")) {
    const Json& coef = json["router_aux_loss_coef"];
    if (!coef.is_number() || !std::isfinite(coef.get<double>()) || coef.get<double>() < 0) {
      return config.Error("router_aux_loss_coef", "must be a finite number >= 0");
    }
    dims.set_router_aux_loss_coef(coef.get<double>());
  } else {
    dims.set_router_aux_loss_coef(0.001);  // transformers' default for both families
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelDims> Gpt2Dims(const ConfigReader& config) {
  v1::ModelDims dims;
  dims.set_architecture(v1::ARCHITECTURE_GPT2);
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_hidden_size, config.Int("n_embd")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_ffn_hidden_size,
                             config.Int("n_inner", 4 * dims.hidden_size())));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_num_layers, config.Int("n_layer")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_num_attention_heads, config.Int("n_head")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_vocab_size, config.Int("vocab_size")));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_max_seq_len, config.Int("n_positions")));
  RETURN_IF_ERROR(
      config.Set(dims, &v1::ModelDims::set_norm_eps, config.Number("layer_norm_epsilon", 1e-5)));
  RETURN_IF_ERROR(config.Set(dims, &v1::ModelDims::set_tie_embeddings,
                             config.Bool("tie_word_embeddings", true)));
  // transformers' "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation, which is
  // what Tessera's GPT-2 MLP computes.
  std::string act;
  ASSIGN_OR_RETURN(act, config.String("activation_function", "gelu_new"));
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    return config.Error("activation_function",
                        absl::StrCat("'", act, "' is not supported (gelu_new, gelu_pytorch_tanh)"));
  }
  RETURN_IF_ERROR(config.Require("scale_attn_weights", true));
  RETURN_IF_ERROR(config.Require("scale_attn_by_inverse_layer_idx", false));
  RETURN_IF_ERROR(config.Require("add_cross_attention", false));
  return dims;
}

// The width of each routed expert of resolved `dims` (0 in the spec means ffn_hidden_size).
int64_t ExpertWidth(const v1::ModelDims& dims) {
  return dims.moe_intermediate_size() > 0 ? dims.moe_intermediate_size() : dims.ffn_hidden_size();
}

// The mixture-of-experts fields AddMoeDims reads, written for `arch` (kHfQwen3Moe or kHfMixtral)
// over the dense fields already in `config`. Every layer is sparse, so Qwen3-MoE's
// intermediate_size (the width of a dense layer) is kept as the spec's ffn_hidden_size; Mixtral's
// experts are intermediate_size wide.
void AddMoeConfig(const v1::ModelDims& dims, const std::string& arch, Json& config) {
  config["num_experts_per_tok"] = dims.num_experts_per_token();
  config["router_aux_loss_coef"] = dims.router_aux_loss_coef();
  config["output_router_logits"] = false;
  if (arch == kHfMixtral) {
    config["model_type"] = "mixtral";
    config["num_local_experts"] = dims.num_experts();
    config["intermediate_size"] = ExpertWidth(dims);
    config["sliding_window"] = nullptr;
    config["router_jitter_noise"] = 0.0;
    config.erase("mlp_bias");
  } else {
    config["model_type"] = "qwen3_moe";
    config["num_experts"] = dims.num_experts();
    config["moe_intermediate_size"] = ExpertWidth(dims);
    config["norm_topk_prob"] = dims.norm_topk_prob();
    config["decoder_sparse_step"] = 1;
    config["mlp_only_layers"] = Json::array();
    config["use_sliding_window"] = false;
    config.erase("mlp_bias");
  }
}

}  // namespace

absl::Status CheckHfExportable(const v1::ModelDims& dims) {
  if (dims.num_experts() == 0) return absl::OkStatus();
  if (dims.shared_expert_intermediate_size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.shared_expert_intermediate_size ", dims.shared_expert_intermediate_size(),
        ": a shared expert has no Hugging Face export (Qwen3MoeForCausalLM and "
        "MixtralForCausalLM have none)"));
  }
  if (!dims.qk_norm() && !dims.norm_topk_prob()) {
    return absl::InvalidArgumentError(
        "model.norm_topk_prob false without qk_norm: MixtralForCausalLM, the export of a "
        "mixture of experts without qk_norm, always renormalises the top-k weights");
  }
  return absl::OkStatus();
}

absl::Status CheckExportPolicy(const v1::JobSpec& spec, const v1::ModelDims& dims) {
  const v1::CheckpointPolicy& policy = spec.checkpoint();
  const bool hf = policy.export_format() == v1::EXPORT_FORMAT_HF;
  if (policy.export_merged() && (!hf || !spec.has_lora())) {
    return absl::InvalidArgumentError(
        "checkpoint.export_merged: needs checkpoint.export_format EXPORT_FORMAT_HF and lora "
        "(it writes the base model with the adapters merged in)");
  }
  if (!hf) return absl::OkStatus();
  if (const absl::Status exportable = CheckHfExportable(dims); !exportable.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint.export_format: EXPORT_FORMAT_HF cannot write this model: ",
        exportable.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelDims> ParseHfConfig(absl::string_view text, absl::string_view source) {
  Json json = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || !json.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  ConfigReader config(json, source);
  if (!json.contains("architectures") || !json["architectures"].is_array() ||
      json["architectures"].size() != 1 || !json["architectures"][0].is_string()) {
    return config.Error("architectures", "must list exactly one architecture");
  }
  const std::string arch = json["architectures"][0].get<std::string>();
  if (arch != kHfLlama && arch != kHfQwen3 && arch != kHfGpt2 && arch != kHfQwen3Moe &&
      arch != kHfMixtral) {
    return config.Error(
        "architectures",
        absl::StrCat("'", arch, "' is not supported; supported: ",
                     absl::StrJoin({kHfLlama, kHfQwen3, kHfQwen3Moe, kHfMixtral, kHfGpt2}, ", ")));
  }
  if (config.Has("rope_scaling")) {
    const Json& scaling = json["rope_scaling"];
    std::string type = "?";
    if (scaling.is_object()) {
      for (const char* key : {"rope_type", "type"}) {
        if (scaling.contains(key) && scaling[key].is_string()) type = scaling[key];
      }
    }
    if (type != "default") {
      return config.Error("rope_scaling",
                          absl::StrCat("rope_type '", type,
                                       "' is not supported (plain RoPE only: null or default)"));
    }
  }
  if (arch == kHfGpt2) return Gpt2Dims(config);
  const bool qwen3 = arch == kHfQwen3 || arch == kHfQwen3Moe;
  auto dims = LlamaFamilyDims(config, qwen3);
  if (!dims.ok() || (arch != kHfQwen3Moe && arch != kHfMixtral)) return dims;
  RETURN_IF_ERROR(AddMoeDims(json, config, arch == kHfMixtral, *dims));
  return dims;
}

absl::StatusOr<v1::ModelDims> ReadHfConfig(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kHfConfigFileName);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open (not a Hugging Face model directory?)"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseHfConfig(buffer.str(), path);
}

std::string HfArchitectureOf(const v1::ModelDims& dims) {
  if (dims.architecture() == v1::ARCHITECTURE_GPT2) return kHfGpt2;
  if (dims.num_experts() > 0) return dims.qk_norm() ? kHfQwen3Moe : kHfMixtral;
  return dims.qk_norm() ? kHfQwen3 : kHfLlama;
}

absl::StatusOr<std::string> HfConfigJson(const v1::ModelDims& dims, absl::string_view base_json) {
  RETURN_IF_ERROR(CheckHfExportable(dims));
  Json config = Json::object();
  if (!base_json.empty()) {
    config = Json::parse(base_json.begin(), base_json.end(), nullptr, false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError("config.json of the source model: not a JSON object");
    }
  }
  const std::string arch = HfArchitectureOf(dims);
  if (base_json.empty()) {
    // A model trained from scratch: transformers' defaults for absent token ids (GPT-2's 50256,
    // Llama's 1 and 2) are another tokenizer's. The byte tokenizer's vocabulary (257 tokens)
    // ends with its eos, which GPT-2's convention also makes the bos; any other vocabulary's
    // tokenizer is not known here, so its ids are left unset rather than guessed.
    const bool bytes = dims.vocab_size() == kByteTokenizerVocabSize;
    const Json eos = bytes ? Json(kByteTokenizerVocabSize - 1) : Json(nullptr);
    config["bos_token_id"] = eos;
    config["eos_token_id"] = eos;
  }
  config["architectures"] = Json::array({arch});
  config["vocab_size"] = dims.vocab_size();
  config["tie_word_embeddings"] = dims.tie_embeddings();
  config["torch_dtype"] = "float32";
  config.erase("dtype");
  if (arch == kHfGpt2) {
    config["model_type"] = "gpt2";
    config["n_embd"] = dims.hidden_size();
    config["n_inner"] = dims.ffn_hidden_size();
    config["n_layer"] = dims.num_layers();
    config["n_head"] = dims.num_attention_heads();
    config["n_positions"] = dims.max_seq_len();
    config["n_ctx"] = dims.max_seq_len();
    config["layer_norm_epsilon"] = dims.norm_eps();
    config["activation_function"] = "gelu_new";
  } else {
    config["model_type"] = arch == kHfQwen3 ? "qwen3" : "llama";
    config["hidden_size"] = dims.hidden_size();
    config["intermediate_size"] = dims.ffn_hidden_size();
    config["num_hidden_layers"] = dims.num_layers();
    config["num_attention_heads"] = dims.num_attention_heads();
    config["num_key_value_heads"] = dims.num_kv_heads();
    config["head_dim"] = dims.head_dim();
    config["max_position_embeddings"] = dims.max_seq_len();
    config["rms_norm_eps"] = dims.norm_eps();
    config["rope_theta"] = dims.rope_theta();
    config["rope_scaling"] = nullptr;
    config["hidden_act"] = "silu";
    config["attention_bias"] = false;
    if (arch == kHfQwen3) {
      config["use_sliding_window"] = false;
    } else {
      config["mlp_bias"] = false;
    }
    if (dims.num_experts() > 0) AddMoeConfig(dims, arch, config);
  }
  return config.dump(2) + "\n";
}

}  // namespace tessera::planner
