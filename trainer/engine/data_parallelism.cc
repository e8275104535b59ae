#include "trainer/engine/data_parallelism.h"

#include <utility>
#include <vector>

namespace tessera::trainer {

void BroadcastFromFirstDataRank(CausalLMImpl& model, const DeviceMesh& mesh) {
  const bool expert_parallel = model.partition().ep.enabled();
  // Every rank initialises from the same seed; the broadcast makes dp rank 0's weights
  // authoritative anyway, as DDP does (the ranks of a dp group hold the same shard). Expert
  // shards differ along ep: they come from the first rank of their edp group.
  for (const auto& item : model.named_parameters()) {
    // Frozen weights (LoRA's base) are the same everywhere: loaded from one source or drawn
    // from one seed.
    if (!item.value().requires_grad()) continue;
    const auto& group = mesh.group(expert_parallel && IsExpertParameter(item.key())
                                       ? MeshDim::kExpertData
                                       : MeshDim::kData);
    if (!group) continue;
    std::vector<at::Tensor> tensors{item.value().data()};
    group->broadcast(tensors)->wait();
  }
}

std::unique_ptr<ShardedEngine> ApplyDataParallel(CausalLM model, const DeviceMesh& mesh,
                                                 ShardedEngineOptions options) {
  options.dp_group = mesh.group(MeshDim::kData);
  options.dp_rank = mesh.coord(MeshDim::kData);
  options.dp_size = mesh.size(MeshDim::kData);
  options.pp_group = mesh.group(MeshDim::kPipeline);
  options.pp_stage = mesh.coord(MeshDim::kPipeline);
  options.pp_size = mesh.size(MeshDim::kPipeline);
  options.ep = model->partition().ep;
  options.edp_group = mesh.group(MeshDim::kExpertData);
  options.edp_rank = mesh.coord(MeshDim::kExpertData);
  options.edp_size = mesh.size(MeshDim::kExpertData);
  options.sharded_collectives_as_all_reduce = !options.device.is_cuda();
  return std::make_unique<ShardedEngine>(std::move(model), options);
}

}  // namespace tessera::trainer
