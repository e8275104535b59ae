// Hugging Face model configs: reads a transformers `config.json` (LlamaForCausalLM, including
// Llama 3; Qwen3ForCausalLM; Qwen3MoeForCausalLM; MixtralForCausalLM; GPT2LMHeadModel) into
// tessera.v1.ModelDims, and writes one back for an export, so a spec `model: {from_pretrained:
// DIR}` resolves without LibTorch and an exported directory loads in
// `transformers.AutoModelForCausalLM.from_pretrained`. Only configs whose forward pass Tessera's
// model computes exactly are accepted: anything else (other architectures, rope_scaling, biases on
// Llama projections, sliding windows, other activations) is refused rather than approximated. Plain
// C++: no LibTorch here.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/model.pb.h"

namespace tessera::planner {

// Name of the config file inside a Hugging Face model directory.
inline constexpr char kHfConfigFileName[] = "config.json";

// The `architectures` entries Tessera reads and writes.
inline constexpr char kHfLlama[] = "LlamaForCausalLM";
inline constexpr char kHfQwen3[] = "Qwen3ForCausalLM";
inline constexpr char kHfGpt2[] = "GPT2LMHeadModel";
// Mixture of experts, with experts in every layer.
inline constexpr char kHfQwen3Moe[] = "Qwen3MoeForCausalLM";
inline constexpr char kHfMixtral[] = "MixtralForCausalLM";

// Parses config.json text into dimensions as the config states them (ResolveModel fills the
// remaining defaults and validates). `source` names the file in messages. INVALID_ARGUMENT naming
// `source` and the field: malformed JSON, an unsupported architecture, a missing or mistyped
// field, a feature Tessera does not implement ("rope_scaling: rope_type 'llama3' is not
// supported").
absl::StatusOr<v1::ModelDims> ParseHfConfig(absl::string_view json, absl::string_view source);

// ParseHfConfig of `dir`/config.json; INVALID_ARGUMENT naming the file when it cannot be read.
absl::StatusOr<v1::ModelDims> ReadHfConfig(const std::string& dir);

// The `architectures` entry of resolved `dims`: GPT2LMHeadModel for ARCHITECTURE_GPT2; with
// experts Qwen3MoeForCausalLM when qk_norm, else MixtralForCausalLM; Qwen3ForCausalLM for
// ARCHITECTURE_LLAMA with qk_norm, else LlamaForCausalLM.
std::string HfArchitectureOf(const v1::ModelDims& dims);

// OK when resolved `dims` has a Hugging Face export (HfArchitectureOf computes the same model);
// INVALID_ARGUMENT naming the model field at fault otherwise: a shared expert, or a mixture of
// experts without qk_norm (exported as Mixtral) whose top-k weights are not renormalised.
absl::Status CheckHfExportable(const v1::ModelDims& dims);

// The final-export fields of `spec`.checkpoint against resolved `dims`, at submission and in the
// trainer before it trains: OK, or INVALID_ARGUMENT naming the field. checkpoint.export_format
// EXPORT_FORMAT_HF needs a model CheckHfExportable accepts; checkpoint.export_merged needs
// EXPORT_FORMAT_HF and LoRA (without adapters there is nothing to merge); under tensor or expert
// parallelism the trainer gathers the whole model for it.
absl::Status CheckExportPolicy(const v1::JobSpec& spec, const v1::ModelDims& dims);

// The byte tokenizer's vocabulary (trainer/data/tokenizer.h): bytes 0..255, then eos 256.
inline constexpr int kByteTokenizerVocabSize = 257;

// config.json text for resolved `dims` with float32 weights. `base_json`, when not empty, is the
// config the model was imported from: its other fields (token ids, ...) are kept and the
// dimensions overwritten. Without it (a model trained from scratch) bos_token_id and eos_token_id
// are the byte tokenizer's eos (256) for its 257-token vocabulary, and null for any other (the
// tokenizer is not known here), never transformers' defaults, which belong to other vocabularies.
// INVALID_ARGUMENT when `base_json` is not a JSON object or CheckHfExportable refuses `dims`.
absl::StatusOr<std::string> HfConfigJson(const v1::ModelDims& dims, absl::string_view base_json);

}  // namespace tessera::planner
