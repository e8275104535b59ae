#include "trainer/parallel/pipeline_parallelism.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/layout_rules.h"

namespace tessera::trainer {

absl::Status CheckPipelineSplits(const v1::ModelDims& dims, int pp) {
  // The rule and its message are the coordinator's (planner/layout_rules.h); tp 1 divides all.
  if (const auto violation = planner::CheckModelDivisibility(dims, /*tensor_parallel=*/1, pp)) {
    return absl::InvalidArgumentError(violation->ToString());
  }
  return absl::OkStatus();
}

PipelineStage PipelineStageOf(const DeviceMesh& mesh, int num_layers) {
  const int stage = mesh.coord(MeshDim::kPipeline), stages = mesh.size(MeshDim::kPipeline);
  const int layers_per_stage = num_layers / stages;
  return PipelineStage{.stage = stage,
                       .stages = stages,
                       .first_layer = stage * layers_per_stage,
                       .num_layers = layers_per_stage};
}

std::optional<PipelineSchedule> MakePipelineSchedule(const DeviceMesh& mesh,
                                                     std::vector<int64_t> activation_shape,
                                                     at::Device device) {
  const int stages = mesh.size(MeshDim::kPipeline);
  if (stages <= 1) return std::nullopt;
  std::vector<int> stage_ranks;
  for (int s = 0; s < stages; ++s) {
    MeshCoords coords = mesh.coords();
    coords.pp = s;
    stage_ranks.push_back(DeviceMesh::RankAt(mesh.shape(), coords));
  }
  return std::make_optional<PipelineSchedule>(
      mesh.group(MeshDim::kPipeline), mesh.coord(MeshDim::kPipeline), std::move(stage_ranks),
      std::move(activation_shape), device);
}

}  // namespace tessera::trainer
