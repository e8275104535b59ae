#include "trainer/parallel/expert_parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "trainer/parallel/peer_wait.h"

namespace tessera::trainer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr char kGroupKey[] = "group";
constexpr char kSendKey[] = "send";
constexpr char kRecvKey[] = "recv";

c10d::ProcessGroup* SavedGroup(AutogradContext* ctx) {
  return reinterpret_cast<c10d::ProcessGroup*>(ctx->saved_data[kGroupKey].toInt());
}

// One all-to-all with split sizes along dim 0 of `input` (contiguous): rows[r] go to rank r.
at::Tensor AllToAll(c10d::ProcessGroup* group, const at::Tensor& input,
                    std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
  at::Tensor in = input.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  at::Tensor out = at::empty(shape, in.options());
  const CollectiveIssue issue =
      IssueCollective(CollectiveKind::kAllToAll, group, TensorBytes(std::vector{in}), in.is_cuda());
  WaitForPeers(group->alltoall_base(out, in, recv_rows, send_rows), issue);
  return out;
}

struct ExchangeRowsFunction : torch::autograd::Function<ExchangeRowsFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, int64_t group,
                            std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
    ctx->saved_data[kGroupKey] = group;
    ctx->saved_data[kSendKey] = send_rows;
    ctx->saved_data[kRecvKey] = recv_rows;
    return AllToAll(reinterpret_cast<c10d::ProcessGroup*>(group), rows, send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // The reverse exchange: what came from rank s goes back to it.
    return {AllToAll(SavedGroup(ctx), grads[0], ctx->saved_data[kRecvKey].toIntVector(),
                     ctx->saved_data[kSendKey].toIntVector()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct MeanOverExpertsFunction : torch::autograd::Function<MeanOverExpertsFunction> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, int64_t group) {
    auto* pg = reinterpret_cast<c10d::ProcessGroup*>(group);
    std::vector<at::Tensor> tensors{x.clone()};
    const CollectiveIssue issue =
        IssueCollective(CollectiveKind::kAllReduce, pg, TensorBytes(tensors), x.is_cuda());
    WaitForPeers(pg->allreduce(tensors), issue);
    return tensors[0] / static_cast<double>(pg->getSize());
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

int64_t GroupHandle(const ExpertParallel& ep) { return reinterpret_cast<int64_t>(ep.group.get()); }

}  // namespace

bool IsExpertParameter(const std::string& name) {
  for (const char* tensor : {"experts.gate", "experts.up", "experts.down"}) {
    if (name == tensor || absl::EndsWith(name, absl::StrCat(".mlp.", tensor))) return true;
  }
  return false;
}

ShardPiece ExpertShardPiece(const ParamShard& shard, const ExpertParallel& ep,
                            const TensorParallel& tp) {
  const std::vector<int64_t>& global_shape = shard.global_shape;
  const std::vector<ShardPiece> tp_pieces = ShardPieces(shard, tp.rank, tp.size);
  TORCH_CHECK(tp_pieces.size() == 1, "an expert tensor's tp shard is one box");
  ShardPiece piece = tp_pieces[0];
  // Without tp (or replicated) ShardPieces leaves the box empty: the whole tensor.
  if (piece.box_shape.empty()) {
    piece.box_shape = global_shape;
    piece.box_offset.assign(global_shape.size(), 0);
  }
  piece.box_shape[0] = ep.LocalExperts(global_shape[0]);
  piece.box_offset[0] = ep.FirstExpert(global_shape[0]);
  piece.numel = 1;
  for (int64_t size : piece.box_shape) piece.numel *= size;
  return piece;
}

torch::Tensor LocalExpertShardOf(const torch::Tensor& full, const ParamShard& shard,
                                 const ExpertParallel& ep, const TensorParallel& tp) {
  torch::Tensor local = full;
  if (ep.enabled()) {
    local = local.narrow(0, ep.FirstExpert(full.size(0)), ep.LocalExperts(full.size(0)));
  }
  local = LocalShardOf(local, shard, tp.rank, tp.size);
  return local.is_same(full) ? full : local.clone(at::MemoryFormat::Contiguous);
}

ExpertParallel ExpertParallelOf(const DeviceMesh& mesh) {
  ExpertParallel ep;
  ep.size = mesh.size(MeshDim::kExpert);
  ep.rank = mesh.coord(MeshDim::kExpert);
  ep.group = mesh.group(MeshDim::kExpert);
  return ep;
}

torch::Tensor ExchangeExpertCounts(const torch::Tensor& counts, const ExpertParallel& ep) {
  if (!ep.enabled()) return counts;
  TORCH_CHECK(counts.dim() == 1 && counts.numel() % ep.size == 0,
              "expert counts must be [ep * local experts], got ", counts.sizes());
  const std::vector<int64_t> equal(ep.size, counts.numel() / ep.size);
  return AllToAll(ep.group.get(), counts, equal, equal);
}

torch::Tensor ExchangeRows(const torch::Tensor& rows, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows, const ExpertParallel& ep) {
  if (!ep.enabled()) return rows;
  TORCH_CHECK(static_cast<int>(send_rows.size()) == ep.size &&
                  static_cast<int>(recv_rows.size()) == ep.size,
              "expert exchange: one split size per ep rank");
  return ExchangeRowsFunction::apply(rows, GroupHandle(ep), send_rows, recv_rows);
}

torch::Tensor MeanOverExperts(const torch::Tensor& x, const ExpertParallel& ep) {
  if (!ep.enabled()) return x;
  return MeanOverExpertsFunction::apply(x, GroupHandle(ep));
}

}  // namespace tessera::trainer
