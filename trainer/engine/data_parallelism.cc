#include "trainer/engine/data_parallelism.h"

#include <utility>
#include <vector>

#include "trainer/parallel/collective_timer.h"

namespace tessera::trainer {

void BroadcastFromFirstDataRank(CausalLMImpl& model, const DeviceMesh& mesh) {
  const bool expert_parallel = model.partition().ep.enabled();
  // Every rank initialises from the same seed; the broadcast makes dp rank 0's weights
  // authoritative anyway, as DDP does (the ranks of a dp group hold the same shard). Expert
  // shards differ along ep: they come from the first rank of their edp group. Dense weights go
  // over dcp: with context parallelism the cp ranks of a replica hold the same weights too (a
  // mixture-of-experts model runs without cp, so edp needs no cp).
  for (const auto& item : model.named_parameters()) {
    // Frozen weights (LoRA's base) are the same everywhere: loaded from one source or drawn
    // from one seed.
    if (!item.value().requires_grad()) continue;
    const auto& group = mesh.group(expert_parallel && IsExpertShardedParameter(item.key())
                                       ? MeshDim::kExpertData
                                       : MeshDim::kDataContext);
    if (!group) continue;
    std::vector<at::Tensor> tensors{item.value().data()};
    // At setup, outside any step: timed for the totals, waited for as before.
    const CollectiveIssue issue = IssueCollective(CollectiveKind::kBroadcast, group.get(),
                                                  TensorBytes(tensors), tensors[0].is_cuda());
    group->broadcast(tensors)->wait();
    RecordCollective(issue);
  }
}

std::unique_ptr<ShardedEngine> ApplyDataParallel(CausalLM model, const DeviceMesh& mesh,
                                                 ShardedEngineOptions options) {
  // The ranks holding the same dense parameters: dp x cp (each cp rank's gradient is that of its
  // part of the sequences, weighed by its share of the counted targets, so the sum over dcp is
  // the global batch's). The data is still dealt by the dp coordinate (MakeLoader).
  options.dp_group = mesh.group(MeshDim::kDataContext);
  options.dp_rank = mesh.coord(MeshDim::kDataContext);
  options.dp_size = mesh.size(MeshDim::kDataContext);
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
