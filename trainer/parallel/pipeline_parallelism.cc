#include "trainer/parallel/pipeline_parallelism.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera::trainer {

absl::Status CheckPipelineSplits(const v1::ModelDims& dims, int pp) {
  if (dims.num_layers() % pp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.layout.pipeline_parallel: ", pp,
                                                   " does not divide the model's ",
                                                   dims.num_layers(), " layers"));
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
    stage_ranks.push_back(DeviceMesh::RankAt(
        mesh.shape(), {s, mesh.coord(MeshDim::kData), mesh.coord(MeshDim::kTensor)}));
  }
  return std::make_optional<PipelineSchedule>(
      mesh.group(MeshDim::kPipeline), mesh.coord(MeshDim::kPipeline), std::move(stage_ranks),
      std::move(activation_shape), device);
}

}  // namespace tessera::trainer
