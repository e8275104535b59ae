#include "trainer/parallel/tensor_parallelism.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tessera::trainer {
namespace {

absl::Status Refuse(const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("parallelism.layout.", field, ": ", problem));
}

}  // namespace

absl::Status CheckTensorParallelSplits(const v1::ModelDims& dims, int tp) {
  if (dims.num_attention_heads() % tp != 0 || dims.num_kv_heads() % tp != 0) {
    return Refuse("tensor_parallel",
                  absl::StrCat(tp, " does not divide the model's ", dims.num_attention_heads(),
                               " attention heads and ", dims.num_kv_heads(),
                               " key/value heads (key/value heads are split, not replicated)"));
  }
  if (dims.ffn_hidden_size() % tp != 0) {
    return Refuse("tensor_parallel",
                  absl::StrCat(tp, " does not divide ffn_hidden_size ", dims.ffn_hidden_size()));
  }
  return absl::OkStatus();
}

absl::Status CheckSequenceParallelSplit(bool sequence_parallel, int seq_len, int tp) {
  if (sequence_parallel && seq_len % tp != 0) {
    return Refuse("sequence_parallel", absl::StrCat("data.seq_len ", seq_len,
                                                    " is not divisible by tensor_parallel ", tp));
  }
  return absl::OkStatus();
}

TensorParallel TensorParallelOf(const DeviceMesh& mesh, bool sequence_parallel) {
  const int size = mesh.size(MeshDim::kTensor);
  return TensorParallel{.group = mesh.group(MeshDim::kTensor),
                        .rank = mesh.coord(MeshDim::kTensor),
                        .size = size,
                        .sequence_parallel = size > 1 && sequence_parallel};
}

}  // namespace tessera::trainer
