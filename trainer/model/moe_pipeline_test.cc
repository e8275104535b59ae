// The router loss a pipelined mixture-of-experts model reports: two interleaved stages of a
// four-layer model (stage 0 holds layers 0 and 2, stage 1 layers 1 and 3, one per chunk), ranks
// as threads on Gloo. After the forward of every chunk, SumRouterAuxLossOver must leave on every
// stage the whole model's router loss and per-layer expert counts, equal to one process's forward
// over the same tokens: every chunk of every stage, not each stage's last chunk.

#include <gtest/gtest.h>

#include <vector>

#include "trainer/model/model.h"
#include "trainer/model/model_dims_fixture.h"
#include "trainer/parallel/mesh_threads.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

constexpr int kLayers = 4;
constexpr int kStages = 2;
constexpr int kChunks = 2;

v1::ModelDims FourLayerMoeDims() {
  v1::ModelSpec spec;
  *spec.mutable_dims() = testing::TinyQwenDims();
  v1::ModelDims* dims = spec.mutable_dims();
  dims->set_num_layers(kLayers);
  dims->set_num_experts(4);
  dims->set_num_experts_per_token(2);
  dims->set_moe_intermediate_size(32);
  dims->set_norm_topk_prob(true);
  dims->set_router_aux_loss_coef(0.05);
  return testing::ResolvedDims(spec);
}

// Stage `stage` of kStages, interleaved: chunk j holds layer stage + j * kStages.
ModelPartition InterleavedStage(int stage) {
  ModelPartition partition;
  partition.first_layer = stage;
  partition.num_layers = 1;
  partition.chunks = kChunks;
  partition.chunk_stride = kStages;
  partition.embedding = stage == 0;
  partition.head = stage == kStages - 1;
  return partition;
}

TEST(MoePipelineTest, InterleavedStagesReportEveryChunksRouterLoss) {
  const v1::ModelDims dims = FourLayerMoeDims();
  ASSERT_EQ(dims.num_layers(), kLayers);
  torch::manual_seed(5);
  const torch::Tensor tokens = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  const torch::Tensor targets = torch::randint(dims.vocab_size(), {2, 16}, torch::kLong);
  torch::manual_seed(11);
  CausalLM whole(dims, 0.02);
  // Evaluation mode: the losses compared below are the cross-entropy alone.
  whole->eval();
  whole->Loss(tokens, targets);
  const double whole_aux = whole->last_router_aux_loss().item<double>();
  const torch::Tensor whole_counts = whole->last_tokens_per_expert();
  ASSERT_EQ(whole_counts.sizes(), (std::vector<int64_t>{kLayers, 4}));

  std::vector<CausalLM> stages;
  for (int stage = 0; stage < kStages; ++stage) {
    torch::manual_seed(11);
    stages.emplace_back(dims, 0.02, InterleavedStage(stage));
    stages.back()->eval();
  }
  // The schedule's order for one micro-batch: chunk 0 of every stage, then chunk 1.
  torch::Tensor h = tokens;
  std::vector<double> last_chunk_aux(kStages);
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    for (int stage = 0; stage < kStages; ++stage) {
      const bool last = chunk == kChunks - 1 && stage == kStages - 1;
      h = stages[stage]->StageForward(h.detach(), last ? targets : torch::Tensor(), {}, chunk);
      last_chunk_aux[stage] = stages[stage]->last_router_aux_loss().item<double>();
    }
  }
  EXPECT_NEAR(h.item<double>(), whole->Loss(tokens, targets).item<double>(), 1e-5);
  // Before the sum each stage holds its last chunk's share only: a quarter of the model's.
  EXPECT_LT(last_chunk_aux[0] + last_chunk_aux[1], 0.75 * whole_aux);

  std::vector<double> reported(kStages);
  std::vector<torch::Tensor> counts(kStages);
  testing::RunMeshThreads(MeshShape{.pp = kStages},
                          [&](int rank, const JoinedGroup&, const DeviceMesh& mesh) {
                            CausalLM& stage = stages[rank];
                            stage->SumRouterAuxLossOver(*mesh.group(MeshDim::kPipeline));
                            reported[rank] = stage->last_router_aux_loss().item<double>();
                            counts[rank] = stage->last_tokens_per_expert();
                          });
  for (int stage = 0; stage < kStages; ++stage) {
    EXPECT_NEAR(reported[stage], whole_aux, 1e-6 * whole_aux) << "stage " << stage;
    ASSERT_TRUE(counts[stage].defined()) << "stage " << stage;
    EXPECT_TRUE(torch::equal(counts[stage], whole_counts)) << "stage " << stage << ":\n"
                                                           << counts[stage] << "\nwant\n"
                                                           << whole_counts;
  }
}

}  // namespace
}  // namespace tessera::trainer
