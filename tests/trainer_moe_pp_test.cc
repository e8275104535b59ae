// Real tessera-trainer processes training a tiny mixture-of-experts model (tiny-llama with four
// layers, 8 experts, top-2, router_aux_loss_coef 0.05) with pipeline parallelism combined with
// tensor parallelism, expert parallelism and interleaved virtual stages, against one process of
// the same model and global batch: every step's loss (cross-entropy plus the weighted router
// loss), the reported router loss and the exported weights agree to float32 reduction-order
// noise.
//  - tp2 x pp2: each stage's experts are split over its tp pair; the router loss of stage 0
//    joins the backward through its output (AttachAuxLoss) on both tp ranks.
//  - pp2 x v2: each stage runs two chunks (stage 0 layers 0 and 2, stage 1 layers 1 and 3); the
//    reported router loss sums every chunk of every stage (CausalLM::SumRouterAuxLossOver).
//  - tp2 x pp2 x v2 and dp2 x ep2 x pp2 x v2: the same with the experts split over tp, or over
//    the data-parallel pair; dp2 x ep2 x tp2 x pp2 (8 ranks): over both at once.
// With one data-parallel replica rank 0's reported router loss is the last micro-batch's over
// the whole model, which one process reports too; with dp2 rank 0 sees other micro-batches.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;

constexpr int kSteps = 12;
// Four layers, so that pp2 x v2 gives every chunk one MoE layer.
constexpr int kLayers = 4;
constexpr char kAuxLossCoef[] = "0.05";

struct MoePipelineCase {
  int dp;
  int ep;
  int tp;
  int pp;
  int v;
  int world() const { return dp * tp * pp; }
};

std::string CaseName(const ::testing::TestParamInfo<MoePipelineCase>& info) {
  const MoePipelineCase& c = info.param;
  return absl::StrCat("dp", c.dp, "_ep", c.ep, "_tp", c.tp, "_pp", c.pp, "_v", c.v);
}

class MoePipelineTrainingTest : public TrainerTrainingTest,
                                public ::testing::WithParamInterface<MoePipelineCase> {
 protected:
  // One intra-op thread per rank, as torchrun and the worker give ranks that share the cores:
  // up to 8 ranks of two spinning OpenMP threads each on a busy 2-core machine wait on each
  // other's descheduled threads for minutes.
  static void SetUpTestSuite() {
    setenv("OMP_NUM_THREADS", "1", /*overwrite=*/1);
    setenv("MKL_NUM_THREADS", "1", /*overwrite=*/1);
    TrainerTrainingTest::SetUpTestSuite();
  }

  static std::vector<std::string> MoeFlags(const std::string& dir, const MoePipelineCase& c) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
    }
    flags.push_back(absl::StrCat("--num_layers=", kLayers));
    flags.push_back("--num_experts=8");
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--router_aux_loss_coef=", kAuxLossCoef));
    flags.push_back(absl::StrCat("--expert_parallel=", c.ep));
    flags.push_back(absl::StrCat("--tensor_parallel=", c.tp));
    flags.push_back(absl::StrCat("--pipeline_parallel=", c.pp));
    flags.push_back(absl::StrCat("--pipeline_virtual_stages=", c.v));
    flags.push_back("--export_safetensors");
    return flags;
  }

  // One process of the same model, exported, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-moe-pp-reference");
      *reference = RunTrainer(MoeFlags(*reference_dir_, {1, 1, 1, 1, 1}));
      return reference;
    }();
    return *run;
  }
  static inline std::string* reference_dir_ = new std::string;
};

TEST_P(MoePipelineTrainingTest, LossesRouterLossAndWeightsMatchOneProcess) {
  const MoePipelineCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  const std::string dir = MakeTempDir("ckpt-moe-pp");
  std::vector<TrainerRun> runs = RunRanks(MoeFlags(dir, c), c.world());
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.world()));
  for (int rank = 0; rank < c.world(); ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps));
  double worst_loss = 0, worst_aux = 0;
  int aux_compared = 0;
  for (const auto& report : runs[0].reports) {
    if (!report.has_metrics()) continue;
    const int64_t step = report.metrics().step();
    const double expected = reference.losses.at(step);
    const double relative = std::abs(report.metrics().loss() - expected) / expected;
    EXPECT_LE(relative, 1e-5) << "step " << step;
    worst_loss = std::max(worst_loss, relative);
    EXPECT_GT(report.metrics().router_aux_loss(), 0) << "step " << step;
    if (c.dp > 1) continue;
    for (const auto& expected_report : reference.reports) {
      if (!expected_report.has_metrics() || expected_report.metrics().step() != step) continue;
      const double want = expected_report.metrics().router_aux_loss();
      ASSERT_GT(want, 0);
      // A report of one chunk or one stage only would be about 1/(pp x v) of this.
      const double aux_relative = std::abs(report.metrics().router_aux_loss() - want) / want;
      EXPECT_LE(aux_relative, 1e-5) << "router loss, step " << step;
      worst_aux = std::max(worst_aux, aux_relative);
      ++aux_compared;
    }
  }
  if (c.dp == 1) {
    EXPECT_EQ(aux_compared, kSteps);
  }
  const auto weights = ReadStepExport(dir, kSteps);
  const auto expected_weights = ReadStepExport(*reference_dir_, kSteps);
  ASSERT_TRUE(expected_weights.contains("layers.3.mlp.experts.down"));
  ASSERT_TRUE(expected_weights.contains("layers.2.mlp.router.weight"));
  const double weight_difference = MaxRelativeDifference(weights, expected_weights);
  std::cout << CaseName({c, 0}) << ": max relative loss difference " << worst_loss
            << ", router loss " << worst_aux << ", max relative weight difference "
            << weight_difference << "\n";
  EXPECT_LE(weight_difference, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoePipelineTrainingTest,
                         ::testing::Values(MoePipelineCase{1, 1, 2, 2, 1},
                                           MoePipelineCase{1, 1, 1, 2, 2},
                                           MoePipelineCase{1, 1, 2, 2, 2},
                                           MoePipelineCase{2, 2, 1, 2, 2},
                                           MoePipelineCase{2, 2, 2, 2, 1}),
                         CaseName);

}  // namespace
}  // namespace tessera
