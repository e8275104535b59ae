// ShardedEngine's unit storage and gathers: the reusable CPU buffers, a ZeRO-3 unit's full
// parameters allocated, all-gathered from the dp ranks' shards and freed again, and the layer
// hooks that gather a layer before its forward and its backward (prefetching the next one).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "trainer/engine/sharded_engine.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {

at::Tensor ShardedEngine::TakeBuffer(int64_t numel, const at::TensorOptions& options) {
  std::vector<at::Tensor>& spare = spare_buffers_[numel];
  if (spare.empty()) return at::empty({numel}, options);
  at::Tensor buffer = std::move(spare.back());
  spare.pop_back();
  return buffer;
}

void ShardedEngine::GiveBuffer(at::Tensor buffer) {
  if (!buffer.is_cpu()) return;  // CUDA's caching allocator already reuses blocks
  std::vector<at::Tensor>& spare = spare_buffers_[buffer.numel()];
  if (static_cast<int>(spare.size()) < kSpareBuffers) spare.push_back(std::move(buffer));
}

void ShardedEngine::AllocateFull(Unit& unit) {
  c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(unit.padded) * unit.full.element_size();
  std::vector<at::DataPtr>& spare = spare_storage_[bytes];
  if (spare.empty()) {
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
  } else {
    storage->set_data_ptr_noswap(std::move(spare.back()));
    spare.pop_back();
  }
  storage->set_nbytes(bytes);
}

void ShardedEngine::StartGather(int u) {
  Unit& unit = units_[u];
  if (unit.gather != GatherState::kFreed || unit.entries.empty()) return;
  AllocateFull(unit);
  if (unit.size == 1) {
    torch::NoGradGuard no_grad;
    unit.full.copy_(unit.owned);
    unit.gather = GatherState::kGathered;
    return;
  }
  unit.gather_work = GatherInto(unit, unit.owned, &unit.gather_issue);
  unit.gather = GatherState::kGathering;
}

c10::intrusive_ptr<c10d::Work> ShardedEngine::GatherInto(Unit& unit, const at::Tensor& shard,
                                                         CollectiveIssue* issue) {
  if (!options_.sharded_collectives_as_all_reduce) {
    at::Tensor input = shard;
    *issue = IssueCollective(CollectiveKind::kAllGather, unit.group.get(),
                             TensorBytes(std::vector{input}), input.is_cuda());
    auto work = unit.group->_allgather_base(unit.full, input);
    WaitNowWhenProbing(work, issue);
    return work;
  }
  // Every rank contributes its shard in place and zeros elsewhere; the sum is the gather.
  torch::NoGradGuard no_grad;
  const int64_t begin = OwnedBegin(unit);
  at::Tensor slot = unit.full.narrow(0, begin, unit.shard);
  if (!slot.is_same(shard) && slot.data_ptr() != shard.data_ptr()) slot.copy_(shard);
  unit.full.narrow(0, 0, begin).zero_();
  unit.full.narrow(0, begin + unit.shard, unit.padded - begin - unit.shard).zero_();
  std::vector<at::Tensor> tensors{unit.full};
  *issue = IssueCollective(CollectiveKind::kAllReduce, unit.group.get(), TensorBytes(tensors),
                           unit.full.is_cuda());
  auto work = unit.group->allreduce(tensors);
  WaitNowWhenProbing(work, issue);
  return work;
}

void ShardedEngine::EnsureGathered(int u) {
  Unit& unit = units_[u];
  StartGather(u);
  if (unit.gather == GatherState::kGathering) {
    WaitForPeers(unit.gather_work, unit.gather_issue);
    unit.gather_work.reset();
    unit.gather = GatherState::kGathered;
  }
}

void ShardedEngine::Free(int u) {
  Unit& unit = units_[u];
  if (unit.gather == GatherState::kFreed || unit.entries.empty()) return;
  if (unit.gather == GatherState::kGathering) WaitForPeers(unit.gather_work, unit.gather_issue);
  unit.gather_work.reset();
  // Release the storage the parameters view, keeping the tensors (and whatever autograd saved
  // of them); the next gather puts fresh memory under the same storage.
  c10::StorageImpl* storage = unit.full.storage().unsafeGetStorageImpl();
  at::DataPtr memory = storage->set_data_ptr(at::DataPtr(nullptr, unit.full.device()));
  std::vector<at::DataPtr>& spare = spare_storage_[storage->nbytes()];
  if (unit.full.is_cpu() && static_cast<int>(spare.size()) < kSpareBuffers) {
    spare.push_back(std::move(memory));
  }
  storage->set_nbytes(0);
  unit.gather = GatherState::kFreed;
}

void ShardedEngine::BeforeLayer(int layer) {
  const int u = 1 + layer;
  EnsureGathered(u);
  if (u + 1 < static_cast<int>(units_.size())) StartGather(u + 1);
}

torch::Tensor ShardedEngine::AfterLayer(int layer, torch::Tensor output) {
  const int u = 1 + layer;
  if (output.requires_grad() && torch::GradMode::is_enabled()) {
    // Runs when backward reaches this layer: its parameters come back, the next one down is
    // prefetched.
    output.register_hook([this, u](const at::Tensor& grad) {
      EnsureGathered(u);
      if (u > 1) StartGather(u - 1);
      return grad;
    });
  }
  Free(u);
  return output;
}

}  // namespace tessera::trainer
