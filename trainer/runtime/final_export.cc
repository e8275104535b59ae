#include "trainer/runtime/final_export.h"

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "trainer/model/hf_weights.h"
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

}  // namespace

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
        RETURN_IF_ERROR(ExportHfModel(*inputs.model, merged, source));
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
