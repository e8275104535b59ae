#include "trainer/parallel/pipeline_parallelism.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/layout_rules.h"

namespace tessera::trainer {

int VirtualStagesOf(const v1::Layout& layout) {
  return layout.pipeline_virtual_stages() == 0 ? 1 : layout.pipeline_virtual_stages();
}

PipelineStage PipelineStageOf(const DeviceMesh& mesh, int num_layers, int virtual_stages) {
  const int stage = mesh.coord(MeshDim::kPipeline), stages = mesh.size(MeshDim::kPipeline);
  const int layers_per_chunk = num_layers / (stages * virtual_stages);
  return PipelineStage{.stage = stage,
                       .stages = stages,
                       .first_layer = stage * layers_per_chunk,
                       .num_layers = layers_per_chunk,
                       .chunks = virtual_stages,
                       .chunk_stride = stages * layers_per_chunk};
}

std::optional<PipelineSchedule> MakePipelineSchedule(const DeviceMesh& mesh,
                                                     std::vector<int64_t> activation_shape,
                                                     at::Device device, int virtual_stages) {
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
      std::move(activation_shape), device, virtual_stages);
}

}  // namespace tessera::trainer
