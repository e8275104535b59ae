// MoeLayerImpl with tensor parallelism (expert tensor parallelism at size tp), ranks as threads on
// Gloo: at tp 2, with and without sequence parallelism, with a shared expert and with ep 2 on top,
// outputs, the aux loss and every gradient must equal those of one unsharded layer over the same
// tokens (float64). Every tp rank adds the same loss, as the trainer's ranks do; the router's
// gradient must then be the whole one on every tp rank (summed inside the layer), except under
// sequence parallelism, where the engine sums the replicated parameters' partial gradients over tp
// (ShardedEngine::SumReplicatedGradients) and the test does the same.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "trainer/model/moe.h"
#include "trainer/parallel/expert_parallel.h"
#include "trainer/parallel/mesh_threads.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

constexpr double kTolerance = 1e-10;
constexpr int64_t kTokensPerReplica = 12;

MoeOptions Options(bool shared) {
  MoeOptions options;
  options.hidden_size = 8;
  options.num_experts = 4;
  options.top_k = 2;
  options.expert_intermediate_size = 6;
  options.norm_topk_prob = true;
  if (shared) {
    options.num_shared_experts = 1;
    options.shared_intermediate_size = 4;
  }
  options.aux_loss_coef = 0.3;
  options.init_std = 0.4;
  return options;
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

bool IsExpert(const std::string& name) { return name.rfind("experts.", 0) == 0; }

// The name a model gives the layer's parameter, for its tp split (ShardOfParameter).
ParamShard ShardOf(const std::string& name, const torch::Tensor& full) {
  return ShardOfParameter("layers.0.mlp." + name, full.sizes().vec());
}

struct Case {
  int ep = 1;
  bool sequence_parallel = false;
  bool shared = false;
};

class MoeTensorParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeTensorParallelTest, MatchesOneLayer) {
  const Case c = GetParam();
  constexpr int kTp = 2;
  const MoeOptions options = Options(c.shared);
  const int64_t h = options.hidden_size;
  torch::manual_seed(11);
  MoeLayer reference(options, torch::kFloat64);
  const torch::Tensor all_tokens = torch::randn({c.ep * kTokensPerReplica, h}, torch::kFloat64);
  const torch::Tensor probe = torch::randn(all_tokens.sizes(), torch::kFloat64);
  const torch::Tensor x_ref = all_tokens.clone().requires_grad_(true);
  const MoeOutput ref = reference->forward(x_ref);
  (ref.output * probe).sum().add(ref.weighted_aux_loss).backward();
  std::map<std::string, torch::Tensor> reference_params, reference_grads;
  for (const auto& item : reference->named_parameters()) {
    reference_params[item.key()] = item.value().detach();
    reference_grads[item.key()] = item.value().grad();
  }

  MeshShape shape;
  shape.dp = c.ep;
  shape.ep = c.ep;
  shape.tp = kTp;
  std::mutex mu;
  testing::RunMeshThreads(shape, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
    const ExpertParallel ep = ExpertParallelOf(mesh);
    const TensorParallel tp{.group = mesh.group(MeshDim::kTensor),
                            .rank = mesh.coord(MeshDim::kTensor),
                            .size = mesh.size(MeshDim::kTensor),
                            .sequence_parallel = c.sequence_parallel};
    ASSERT_EQ(tp.size, kTp);
    MoeLayer layer(nullptr);
    {
      // The generator is process-wide: the threads draw their (overwritten) weights in turn.
      const std::lock_guard<std::mutex> lock(mu);
      layer = MoeLayer(options, torch::kFloat64, ep, tp);
    }
    std::map<std::string, torch::Tensor> expected_shard;
    {
      const torch::NoGradGuard no_grad;
      for (auto& item : layer->named_parameters()) {
        const torch::Tensor& full = reference_params.at(item.key());
        const ParamShard shard = ShardOf(item.key(), full);
        const torch::Tensor local = IsExpert(item.key())
                                        ? LocalExpertShardOf(full, shard, ep, tp)
                                        : LocalShardOf(full, shard, tp.rank, tp.size);
        ASSERT_EQ(item.value().sizes(), local.sizes()) << item.key();
        item.value().copy_(local);
        const torch::Tensor& grad = reference_grads.at(item.key());
        expected_shard[item.key()] = IsExpert(item.key())
                                         ? LocalExpertShardOf(grad, shard, ep, tp)
                                         : LocalShardOf(grad, shard, tp.rank, tp.size);
      }
    }
    // This replica's tokens as one sequence [1, T, h]; under sequence parallelism this tp rank's
    // part of it.
    const int64_t begin = ep.rank * kTokensPerReplica;
    const int64_t part = c.sequence_parallel ? kTokensPerReplica / kTp : kTokensPerReplica;
    const int64_t first = begin + (c.sequence_parallel ? tp.rank * part : 0);
    const torch::Tensor x =
        all_tokens.narrow(0, first, part).reshape({1, part, h}).clone().requires_grad_(true);
    const MoeOutput out = layer->forward(x);
    EXPECT_LT(MaxAbsDiff(out.output.reshape({part, h}), ref.output.narrow(0, first, part)),
              kTolerance)
        << "rank " << rank;
    EXPECT_NEAR(out.aux_loss.item<double>(), ref.aux_loss.item<double>(), kTolerance);
    // Every rank's aux term is the union's; each ep replica adds 1/ep of it (as in
    // moe_expert_parallel_test), each tp rank the same.
    (out.output.reshape({part, h}) * probe.narrow(0, first, part))
        .sum()
        .add(out.weighted_aux_loss / static_cast<double>(c.ep))
        .backward();
    EXPECT_LT(MaxAbsDiff(x.grad().reshape({part, h}), x_ref.grad().narrow(0, first, part)),
              kTolerance)
        << "rank " << rank;
    for (auto& item : layer->named_parameters()) {
      torch::Tensor grad = item.value().grad();
      ASSERT_TRUE(grad.defined()) << item.key() << " on rank " << rank;
      grad = grad.clone();
      const ParamShard shard = ShardOf(item.key(), reference_params.at(item.key()));
      if (c.sequence_parallel && shard.kind == ParamShard::Kind::kReplicated) {
        AllReduceSum(tp.group, grad);
      }
      // The experts' gradients hold every ep rank's tokens; the rest are this replica's part.
      if (!IsExpert(item.key())) AllReduceSum(ep.group, grad);
      EXPECT_LT(MaxAbsDiff(grad, expected_shard.at(item.key())), kTolerance)
          << item.key() << " on rank " << rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MoeTensorParallelTest,
    ::testing::Values(Case{}, Case{.sequence_parallel = true}, Case{.shared = true},
                      Case{.sequence_parallel = true, .shared = true}, Case{.ep = 2},
                      Case{.ep = 2, .sequence_parallel = true, .shared = true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      return "Tp2" + std::string(c.ep > 1 ? "Ep2" : "") + (c.sequence_parallel ? "Sp" : "") +
             (c.shared ? "Shared" : "");
    });

TEST(MoeTensorParallelInitTest, ShardIsTheSliceOfTheUnshardedDraw) {
  const MoeOptions options = Options(/*shared=*/true);
  torch::manual_seed(3);
  MoeLayer whole(options, torch::kFloat64);
  ExpertParallel ep;  // no groups needed to build: the weights alone
  ep.size = 2;
  ep.rank = 1;
  TensorParallel tp;
  tp.size = 2;
  tp.rank = 1;
  torch::manual_seed(3);
  MoeLayer shard(options, torch::kFloat64, ep, tp);
  const std::map<std::string, std::vector<int64_t>> local_shapes = {
      {"router.weight", {4, 8}},   {"experts.gate", {2, 3, 8}},    {"experts.up", {2, 3, 8}},
      {"experts.down", {2, 8, 3}}, {"shared.gate", {2, 8}},        {"shared.up", {2, 8}},
      {"shared.down", {8, 2}},     {"shared.sigmoid_gate", {1, 8}}};
  for (const auto& item : shard->named_parameters()) {
    const torch::Tensor full = whole->named_parameters()[item.key()];
    EXPECT_EQ(item.value().sizes().vec(), local_shapes.at(item.key())) << item.key();
    const ParamShard split = ShardOf(item.key(), full);
    const torch::Tensor expected = IsExpert(item.key())
                                       ? LocalExpertShardOf(full, split, ep, tp)
                                       : LocalShardOf(full, split, tp.rank, tp.size);
    EXPECT_TRUE(torch::equal(item.value(), expected)) << item.key();
  }
  // The checkpoint box of an expert shard: experts [2, 4) and this tp rank's half of f.
  const ShardPiece gate =
      ExpertShardPiece(ShardOf("experts.gate", torch::empty({4, 6, 8})), ep, tp);
  EXPECT_EQ(gate.box_offset, (std::vector<int64_t>{2, 3, 0}));
  EXPECT_EQ(gate.box_shape, (std::vector<int64_t>{2, 3, 8}));
  EXPECT_EQ(gate.numel, 48);
  const ShardPiece down =
      ExpertShardPiece(ShardOf("experts.down", torch::empty({4, 8, 6})), ep, tp);
  EXPECT_EQ(down.box_offset, (std::vector<int64_t>{2, 0, 3}));
  EXPECT_EQ(down.box_shape, (std::vector<int64_t>{2, 8, 3}));
}

TEST(MoeTensorParallelInitTest, RefusesAWidthTpDoesNotDivide) {
  MoeOptions options = Options(/*shared=*/false);
  options.expert_intermediate_size = 5;
  TensorParallel tp;
  tp.size = 2;
  EXPECT_THROW(MoeLayer(options, torch::kFloat64, ExpertParallel{}, tp), c10::Error);
}

}  // namespace
}  // namespace tessera::trainer
