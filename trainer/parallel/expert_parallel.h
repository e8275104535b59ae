// Expert parallelism for mixture-of-experts layers (GShard, Lepikhin et al. 2020; as torchtitan
// and Megatron-Core fold it into data parallelism): the ep ranks of a group each hold
// num_experts / ep consecutive experts, and every rank sends each of its routed token slots to the
// rank holding the slot's expert by an all-to-all with split sizes, gets the expert outputs back
// by the reverse all-to-all, and combines them itself. This header holds the split and its
// autograd-aware exchanges; the layer that uses them is trainer/model/moe.h.
//
// Collectives are issued on the calling thread (forward) or autograd's (backward) and waited for;
// every ep rank runs the same sequence of them (one all-to-all of counts and two of rows per MoE
// layer and pass).
#pragma once

#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "absl/status/status.h"
#include "tessera/v1/model.pb.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {

struct ExpertParallel {
  // The ep group (MeshDim::kExpert); null when size is 1.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0;
  int size = 1;
  bool enabled() const { return size > 1; }
  // The experts [first_expert, first_expert + local_experts) this rank holds of `num_experts`.
  int64_t LocalExperts(int64_t num_experts) const { return num_experts / size; }
  int64_t FirstExpert(int64_t num_experts) const { return rank * LocalExperts(num_experts); }
};

// Whether a model parameter is a routed expert tensor, split along dim 0 over ep
// ("layers.N.mlp.experts.gate", ".up", ".down", or the layer's own "experts.gate", ...); the
// router, the shared experts and any adapter tensors are not.
bool IsExpertParameter(const std::string& name);

// Where this rank's shard of an expert tensor lies (`shard` holds its logical shape and its tp
// split, ShardOfParameter's kExpertColumn / kExpertRow): one piece, the local tensor whole, a box
// of num_experts / ep experts from FirstExpert and, with tp, this tp rank's slice of the split
// dim (ShardPieces).
ShardPiece ExpertShardPiece(const ParamShard& shard, const ExpertParallel& ep,
                            const TensorParallel& tp);

// This rank's shard of the whole stacked expert tensor `full` (logical shape): its ep experts,
// then its tp slice. Contiguous, sharing no storage with `full` when anything was cut.
torch::Tensor LocalExpertShardOf(const torch::Tensor& full, const ParamShard& shard,
                                 const ExpertParallel& ep, const TensorParallel& tp);

// This rank's expert-parallel split on the mesh (the kExpert group, coordinate and size).
ExpertParallel ExpertParallelOf(const DeviceMesh& mesh);

// The all-to-all of per-expert counts: `counts` int64 [ep * n] holds this rank's counts for
// every rank's n local experts (rank r's at [r * n, (r + 1) * n)); the result, [ep * n], holds
// at [s * n, (s + 1) * n) rank s's counts for this rank's experts. Not differentiable.
torch::Tensor ExchangeExpertCounts(const torch::Tensor& counts, const ExpertParallel& ep);

// The all-to-all of rows: rows [sum(send_rows), ...] in destination-rank order, send_rows[r] of
// them to rank r; returns [sum(recv_rows), ...] in source-rank order. Differentiable: the
// gradient goes back by the reverse exchange. Identity when ep is off.
torch::Tensor ExchangeRows(const torch::Tensor& rows, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, const ExpertParallel& ep);

// The mean of `x` over the ep group in forward; identity in backward, so that each rank's
// gradient flows to its own contribution only (the gradient of a term every rank adds alike,
// which the data-parallel mean of the gradients then averages; see MoeLayerImpl::forward).
torch::Tensor MeanOverExperts(const torch::Tensor& x, const ExpertParallel& ep);

}  // namespace tessera::trainer
