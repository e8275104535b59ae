// Hugging Face weights in and out: loads a transformers model directory (config.json plus
// model.safetensors, or the shards model.safetensors.index.json lists) into a CausalLM, and
// writes a CausalLM as such a directory, which `transformers.AutoModelForCausalLM
// .from_pretrained` loads and which computes the same logits. Names follow transformers'
// LlamaForCausalLM / Qwen3ForCausalLM ("model.layers.N.self_attn.q_proj.weight") and
// GPT2LMHeadModel ("transformer.h.N.attn.c_attn.weight", whose Conv1D weights are stored
// [in, out], the transpose of Tessera's). Rotary q/k need no permutation: transformers stores them
// for rotate-half RoPE, the convention Tessera computes. Loading fills only what this rank holds
// (its pipeline stage's layers, its tensor-parallel shard), so every layout loads. LibTorch's
// errors are caught here and returned as statuses.
#pragma once

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/lora.h"
#include "tessera/v1/job.pb.h"
#include "trainer/model/model.h"

namespace tessera::trainer {

// File names inside a Hugging Face model directory.
inline constexpr char kHfWeightsFileName[] = "model.safetensors";
inline constexpr char kHfWeightsIndexFileName[] = "model.safetensors.index.json";

// Copies the weights of the Hugging Face directory `dir` into `model`'s parameters (float32;
// F32, F16, BF16 and F64 files are converted). `model` must be built from the dims of
// `dir`/config.json (planner::ReadHfConfig). Tensors the model has no use for (a tied lm_head,
// GPT-2's attention-mask buffers) are ignored. INVALID_ARGUMENT naming the file and the tensor
// when a tensor is missing, has another shape or an unsupported dtype, or the directory has no
// weights; the reader's DATA_LOSS naming the file for a corrupt or truncated one.
absl::Status LoadHfWeights(CausalLMImpl& model, const std::string& dir);

// LoadHfWeights' values without the copy, for a ZeRO-3 engine of a ParameterStorage::kDeferred
// model (ShardedEngine::InitializeShards): the model's parameters are checked against the
// files' headers here (LoadHfWeights' INVALID_ARGUMENT errors); each call reads one tensor and
// returns this rank's part of it (DATA_LOSS for a corrupt or truncated file).
absl::StatusOr<ParameterValues> HfWeightValues(const CausalLMImpl& model, const std::string& dir);

// Copies the weights of a Tessera safetensors export (`--export_safetensors`, `--export_initial`:
// Tessera's parameter names, whole tensors) into `model`, with LoadHfWeights' errors.
absl::Status LoadTesseraWeights(CausalLMImpl& model, const std::string& file);

// File names of a PEFT adapter directory.
inline constexpr char kPeftConfigFileName[] = "adapter_config.json";
inline constexpr char kPeftWeightsFileName[] = "adapter_model.safetensors";

// Options for a model with LoRA adapters (CausalLMImpl::AddLora) from a resolved spec.
LoraOptions LoraOptionsOf(const planner::ResolvedLora& lora);

// Every LoRA adapter of `model` by its Tessera name, each the whole logical tensor on the CPU in
// float32: an adapter split over tensor parallelism is all-gathered over the tp group and an
// expert adapter sharded over expert parallelism over the ep group (GatherWholeTensor), so with
// tp or ep > 1 every rank of those groups must call this at the same point (a collective);
// without them it only copies. INTERNAL for LibTorch's errors.
using LoraAdapterValues = std::map<std::string, torch::Tensor>;
absl::StatusOr<LoraAdapterValues> GatherLoraAdapters(CausalLMImpl& model);

// Writes the LoRA adapters of `model` (`gathered` from GatherLoraAdapters, or, when null, the
// model's own, which must then be whole on this rank: FAILED_PRECONDITION under expert
// parallelism) to `dir` in PEFT's layout:
// adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
// target_modules, base_model_name_or_path = `base_model`) and adapter_model.safetensors with
// PEFT's names ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", float32), which
// peft.PeftModel.from_pretrained loads onto the base model. FAILED_PRECONDITION when the model
// has no adapters; INTERNAL naming the file when it cannot be written.
absl::Status ExportPeftAdapter(CausalLMImpl& model, const planner::ResolvedLora& lora,
                               const std::string& dir, const std::string& base_model,
                               const LoraAdapterValues* gathered = nullptr);

// The LoraSpec of a PEFT adapter directory's adapter_config.json (LoRA only: r, lora_alpha,
// lora_dropout, target_modules). NOT_FOUND / INVALID_ARGUMENT naming the file and field.
absl::StatusOr<v1::LoraSpec> ReadPeftAdapterConfig(const std::string& dir);

// Copies a PEFT adapter directory's adapter_model.safetensors into `model`'s adapters (added
// with AddLora from ReadPeftAdapterConfig's spec); under expert parallelism each rank takes its
// experts' adapters, and under tensor parallelism its part of each (lora.h). INVALID_ARGUMENT naming the file and tensor
// when one is missing or has another shape.
absl::Status LoadPeftAdapterWeights(CausalLMImpl& model, const std::string& dir);

// Copies the tokenizer and generation files of the Hugging Face directory `source_dir`
// (generation_config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// tokenizer.model, vocab.json, merges.txt, added_tokens.json: those present) into `dir`, created
// if needed; nothing when `source_dir` is empty. INTERNAL naming the file that cannot be copied.
absl::Status CopyHfSourceFiles(const std::string& source_dir, const std::string& dir);

// Writes `model` (the whole model on this rank: no tensor, pipeline or expert split) to `dir` as
// a Hugging Face directory (LoRA adapters, if any, merged into their layers' weights):
// config.json (float32), model.safetensors under transformers' names (an MoE layer's stacked
// experts as one tensor per expert: Qwen3MoeForCausalLM, MixtralForCausalLM),
// generation_config.json. `source_dir`, when not empty, is the directory the model was imported
// from: its config.json's other fields (token ids, ...) are kept, and its generation config and
// tokenizer files are copied. FAILED_PRECONDITION for a partial model; planner::CheckHfExportable's
// INVALID_ARGUMENT for a model with no Hugging Face form; INTERNAL naming the file when it cannot
// be written.
absl::Status ExportHfModel(CausalLMImpl& model, const std::string& dir,
                           const std::string& source_dir = "");

}  // namespace tessera::trainer
