// MoeLayerImpl with expert parallelism, ranks as threads on Gloo: at ep 2 and 4 each rank holds
// num_experts / ep experts and its own tokens; outputs, the aux loss and every gradient must equal
// those of one unsharded layer over the union of the ranks' tokens (float64).
#include <gtest/gtest.h>

#include <cmath>
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
constexpr int64_t kTokensPerRank = 12;

MoeOptions Options(bool shared) {
  MoeOptions options;
  options.hidden_size = 8;
  options.num_experts = 8;
  options.top_k = 2;
  options.expert_intermediate_size = 6;
  options.norm_topk_prob = true;
  if (shared) {
    options.num_shared_experts = 1;
    options.shared_intermediate_size = 5;
  }
  options.aux_loss_coef = 0.3;
  options.init_std = 0.4;
  return options;
}

double MaxAbsDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

struct Case {
  int ep = 2;
  bool shared = false;
  // Every token prefers experts 0 and 1: the other ep ranks receive no rows at all.
  bool skewed = false;
};

class MoeExpertParallelTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeExpertParallelTest, MatchesOneLayerOverTheUnionOfTokens) {
  const Case c = GetParam();
  const MoeOptions options = Options(c.shared);
  torch::manual_seed(7);
  MoeLayer reference(options, torch::kFloat64);
  torch::Tensor all_tokens =
      torch::randn({c.ep * kTokensPerRank, options.hidden_size}, torch::kFloat64);
  if (c.skewed) {
    const torch::NoGradGuard no_grad;
    torch::Tensor router = reference->named_parameters()["router.weight"];
    router.select(1, 0).fill_(-3.0);
    router.select(1, 0).narrow(0, 0, 2).fill_(3.0);
    all_tokens.select(1, 0).abs_().add_(5.0);
  }
  const torch::Tensor probe = torch::randn(all_tokens.sizes(), torch::kFloat64);

  // The reference: one layer over every token; the loss weighs each output element differently
  // and adds the weighted aux loss.
  const torch::Tensor x_ref = all_tokens.clone().requires_grad_(true);
  const MoeOutput ref = reference->forward(x_ref);
  (ref.output * probe).sum().add(ref.weighted_aux_loss).backward();
  if (c.skewed) {
    const torch::Tensor counts = ref.tokens_per_expert;
    ASSERT_EQ(counts.narrow(0, 2, options.num_experts - 2).sum().item<int64_t>(), 0)
        << "the skewed case must leave experts 2.. without tokens";
  }

  std::map<std::string, torch::Tensor> reference_params;
  for (const auto& item : reference->named_parameters()) {
    reference_params[item.key()] = item.value().detach();
  }

  MeshShape shape;
  shape.dp = c.ep;
  shape.ep = c.ep;
  std::mutex mu;
  testing::RunMeshThreads(shape, [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
    const ExpertParallel ep = ExpertParallelOf(mesh);
    ASSERT_EQ(ep.size, c.ep);
    ASSERT_EQ(ep.rank, rank);
    const int64_t local = options.num_experts / c.ep, first = rank * local;
    MoeLayer layer(nullptr);
    {
      // The generator is process-wide: the threads draw their (overwritten) weights in turn.
      const std::lock_guard<std::mutex> lock(mu);
      layer = MoeLayer(options, torch::kFloat64, ep);
    }
    {
      const torch::NoGradGuard no_grad;
      for (auto& item : layer->named_parameters()) {
        const torch::Tensor& full = reference_params.at(item.key());
        const bool expert = item.key().rfind("experts.", 0) == 0;
        ASSERT_EQ(item.value().size(0), expert ? local : full.size(0)) << item.key();
        item.value().copy_(expert ? full.narrow(0, first, local) : full);
      }
    }
    const torch::Tensor x =
        all_tokens.narrow(0, rank * kTokensPerRank, kTokensPerRank).clone().requires_grad_(true);
    const MoeOutput out = layer->forward(x);
    EXPECT_LT(MaxAbsDiff(out.output, ref.output.narrow(0, rank * kTokensPerRank, kTokensPerRank)),
              kTolerance)
        << "rank " << rank;
    EXPECT_NEAR(out.aux_loss.item<double>(), ref.aux_loss.item<double>(), kTolerance);
    // Each rank's aux term is the union's; every rank adds 1/ep of it, so that the dense
    // gradients' sum over the ranks is the union's gradient.
    (out.output * probe.narrow(0, rank * kTokensPerRank, kTokensPerRank))
        .sum()
        .add(out.weighted_aux_loss / static_cast<double>(c.ep))
        .backward();
    EXPECT_LT(MaxAbsDiff(x.grad(), x_ref.grad().narrow(0, rank * kTokensPerRank, kTokensPerRank)),
              kTolerance);
    for (auto& item : layer->named_parameters()) {
      const torch::Tensor full_grad = reference->named_parameters()[item.key()].grad();
      torch::Tensor grad = item.value().grad();
      ASSERT_TRUE(grad.defined()) << item.key() << " on rank " << rank;
      if (item.key().rfind("experts.", 0) == 0) {
        // The experts' gradients hold every ep rank's tokens already.
        EXPECT_LT(MaxAbsDiff(grad, full_grad.narrow(0, first, local)), kTolerance)
            << item.key() << " on rank " << rank;
      } else {
        grad = grad.clone();
        AllReduceSum(mesh.group(MeshDim::kExpert), grad);
        EXPECT_LT(MaxAbsDiff(grad, full_grad), kTolerance) << item.key() << " on rank " << rank;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Degrees, MoeExpertParallelTest,
    ::testing::Values(Case{.ep = 2}, Case{.ep = 4}, Case{.ep = 2, .shared = true},
                      Case{.ep = 4, .shared = true}, Case{.ep = 4, .skewed = true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      return "Ep" + std::to_string(c.ep) + (c.shared ? "Shared" : "") + (c.skewed ? "Skewed" : "");
    });

TEST(MoeExpertParallelInitTest, ShardIsTheSliceOfTheUnshardedDraw) {
  const MoeOptions options = Options(/*shared=*/false);
  torch::manual_seed(3);
  MoeLayer whole(options, torch::kFloat64);
  ExpertParallel ep;  // no group needed to build: the weights alone
  ep.size = 4;
  ep.rank = 3;
  torch::manual_seed(3);
  MoeLayer shard(options, torch::kFloat64, ep);
  for (const auto& item : shard->named_parameters()) {
    const torch::Tensor full = whole->named_parameters()[item.key()];
    const bool expert = item.key().rfind("experts.", 0) == 0;
    EXPECT_TRUE(torch::equal(item.value(), expert ? full.narrow(0, 6, 2) : full)) << item.key();
  }
}

}  // namespace
}  // namespace tessera::trainer
