// Real tessera-trainer processes training the tiny mixture-of-experts model (tiny-llama, 8
// experts, top-2, in both blocks) with the routers' load-balancing loss on
// (router_aux_loss_coef 0.05), in layouts beyond plain expert parallelism, against one process
// of the same model and global batch: every step's loss (cross-entropy plus the weighted router
// loss) and the exported weights agree to float32 reduction-order noise.
//  - pp2: each stage holds one MoE block; its layer's router loss enters that stage's backward
//    (a middle stage through its output, AttachAuxLoss) and the step's loss sums the stages'.
//  - pp2 x dp2 x ep2: the same with the experts split over the data-parallel pair.
//  - dp2 x ep2: each rank's router loss covers its own micro-batches' tokens, which are exactly
//    the micro-batches one process sees (the loss is taken per forward call, as transformers
//    does), so the router loss needs no reduction over ranks to match one process.

#include <algorithm>
#include <cmath>
#include <cstdint>
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
constexpr char kAuxLossCoef[] = "0.05";

struct MoeLayoutCase {
  int dp;
  int ep;
  int pp;
  int world() const { return dp * pp; }
};

std::string CaseName(const ::testing::TestParamInfo<MoeLayoutCase>& info) {
  return absl::StrCat("dp", info.param.dp, "_ep", info.param.ep, "_pp", info.param.pp);
}

class MoeLayoutTrainingTest : public TrainerTrainingTest,
                              public ::testing::WithParamInterface<MoeLayoutCase> {
 protected:
  static std::vector<std::string> MoeFlags(const std::string& dir, const MoeLayoutCase& c) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
    }
    flags.push_back("--num_experts=8");
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--router_aux_loss_coef=", kAuxLossCoef));
    flags.push_back(absl::StrCat("--expert_parallel=", c.ep));
    flags.push_back(absl::StrCat("--pipeline_parallel=", c.pp));
    flags.push_back("--export_safetensors");
    return flags;
  }

  // One process of the same model, exported, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-moe-layouts-reference");
      *reference = RunTrainer(MoeFlags(*reference_dir_, {1, 1, 1}));
      return reference;
    }();
    return *run;
  }
  static inline std::string* reference_dir_ = new std::string;
};

TEST_P(MoeLayoutTrainingTest, LossesAndWeightsMatchOneProcess) {
  const MoeLayoutCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  const std::string dir = MakeTempDir("ckpt-moe-layout");
  std::vector<TrainerRun> runs = RunRanks(MoeFlags(dir, c), c.world());
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.world()));
  for (int rank = 0; rank < c.world(); ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps));
  double worst_loss = 0, worst_aux = 0;
  for (const auto& report : runs[0].reports) {
    if (!report.has_metrics()) continue;
    const int64_t step = report.metrics().step();
    const double expected = reference.losses.at(step);
    const double relative = std::abs(report.metrics().loss() - expected) / expected;
    EXPECT_LE(relative, 1e-4) << "step " << step;
    worst_loss = std::max(worst_loss, relative);
    // The reported router loss is the last micro-batch's on rank 0, which one process's last
    // micro-batch equals under pipeline parallelism alone (the stages' shares summed); a
    // data-parallel rank 0 sees other micro-batches.
    if (c.dp == 1) {
      for (const auto& expected_report : reference.reports) {
        if (!expected_report.has_metrics() || expected_report.metrics().step() != step) continue;
        const double want = expected_report.metrics().router_aux_loss();
        ASSERT_GT(want, 0);
        const double aux_relative = std::abs(report.metrics().router_aux_loss() - want) / want;
        EXPECT_LE(aux_relative, 1e-4) << "router loss, step " << step;
        worst_aux = std::max(worst_aux, aux_relative);
      }
    }
  }
  const auto weights = ReadStepExport(dir, kSteps);
  const auto expected_weights = ReadStepExport(*reference_dir_, kSteps);
  ASSERT_TRUE(expected_weights.contains("layers.1.mlp.experts.gate"));
  ASSERT_TRUE(expected_weights.contains("layers.0.mlp.router.weight"));
  const double weight_difference = MaxRelativeDifference(weights, expected_weights);
  std::cout << CaseName({c, 0}) << ": max relative loss difference " << worst_loss
            << ", router loss " << worst_aux << ", max relative weight difference "
            << weight_difference << "\n";
  EXPECT_LE(weight_difference, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLayoutTrainingTest,
                         ::testing::Values(MoeLayoutCase{1, 1, 2}, MoeLayoutCase{2, 2, 2},
                                           MoeLayoutCase{2, 2, 1}),
                         CaseName);

}  // namespace
}  // namespace tessera
