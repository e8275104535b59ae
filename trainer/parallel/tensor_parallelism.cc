#include "trainer/parallel/tensor_parallelism.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "planner/layout_rules.h"

namespace tessera::trainer {
namespace {

absl::Status Refuse(const std::string& field, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("parallelism.layout.", field, ": ", problem));
}

}  // namespace

absl::Status CheckTensorParallelSplits(const v1::ModelDims& dims, int tp) {
  // The rule and its message are the coordinator's (planner/layout_rules.h); pp 1 divides all.
  if (const auto violation = planner::CheckModelDivisibility(dims, tp, /*pipeline_parallel=*/1)) {
    return absl::InvalidArgumentError(violation->ToString());
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
