// A job's final export in Hugging Face's format (checkpoint.export_format EXPORT_FORMAT_HF), written
// by rank 0 once the last checkpoint is committed, under <checkpoint directory>/export:
//   hf/         without LoRA: the trained model as transformers loads it (config.json,
//               model.safetensors under transformers' names, generation_config.json, and the
//               tokenizer files of model.from_pretrained's directory when the model was imported);
//               with LoRA: the PEFT adapter directory (adapter_config.json,
//               adapter_model.safetensors) and those tokenizer files.
//   hf-merged/  with LoRA and checkpoint.export_merged: the base with the adapters merged in.
// Without LoRA the weights come from the committed checkpoint's Tessera export (model.safetensors,
// which FinalExportNeedsTesseraFile asks the checkpointer for), so every layout exports: no rank
// need hold the whole model. That costs rank 0 one float32 copy of the model in host memory while
// it writes. With LoRA rank 0's model is written directly when it is whole; under tensor or expert
// parallelism its adapters come gathered from every tp and ep rank (GatherLoraAdapters), and the
// merged export from a whole copy of the model that every rank helped gather
// (GatherMergedExportModel): base weights, an NF4 base dequantized, and adapters.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/lora.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/model/hf_weights.h"
#include "trainer/model/model.h"

namespace tessera::trainer {

// Subdirectories of the checkpoint directory.
inline constexpr char kHfExportDir[] = "export/hf";
inline constexpr char kHfMergedExportDir[] = "export/hf-merged";

// Whether the final checkpoint must also write the Tessera safetensors export for `spec`
// (export_safetensors or EXPORT_FORMAT_TESSERA, or EXPORT_FORMAT_HF without LoRA, which reads
// it).
bool FinalExportNeedsTesseraFile(const v1::JobSpec& spec);

// What WriteFinalHfExport reads.
struct FinalExportInputs {
  const v1::TrainerTask* task = nullptr;
  // The run's resolved model (the plan's).
  const v1::ModelSummary* summary = nullptr;
  // The committed final checkpoint's directory (v1::Checkpoint::path).
  std::string checkpoint_path;
  // Rank 0's model and, with LoRA, its resolved spec.
  CausalLMImpl* model = nullptr;
  const planner::ResolvedLora* lora = nullptr;
  // With LoRA, every adapter whole (GatherLoraAdapters, which every rank joined); null: rank 0's
  // model's own, whole only without expert parallelism.
  const LoraAdapterValues* lora_adapters = nullptr;
  // With LoRA and export_merged under tp or ep > 1, the whole model GatherMergedExportModel made;
  // null: `model` is whole.
  CausalLMImpl* merged_model = nullptr;
};

// For a spec whose final export writes the merged model (EXPORT_FORMAT_HF, LoRA, export_merged)
// when `model` is not whole on this rank (tensor or expert parallelism; LoRA runs without
// pipeline stages): every base weight (an NF4 one dequantized to float32) gathered whole over tp
// and ep, and `adapters` (GatherLoraAdapters'), in a new CausalLM on the CPU without a partition,
// with `model`'s LoRA options. A collective: every rank calls it at the same point; ranks with
// `keep` false join the gathers and get a null model, as do all ranks when nothing needs it.
// INTERNAL for LibTorch's errors or a parameter with no gathered value.
absl::StatusOr<CausalLM> GatherMergedExportModel(const v1::JobSpec& spec, CausalLMImpl& model,
                                                 const LoraAdapterValues& adapters, bool keep);

// Writes the directories above for a task whose spec asks for EXPORT_FORMAT_HF (OK and nothing
// written otherwise) and returns the directories written. The spec was checked by
// planner::CheckExportPolicy; errors here are the writers' (INTERNAL naming the file) or LibTorch's.
absl::StatusOr<std::vector<std::string>> WriteFinalHfExport(const FinalExportInputs& inputs);

}  // namespace tessera::trainer
