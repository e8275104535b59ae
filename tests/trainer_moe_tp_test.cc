// Real tessera-trainer processes training the tiny mixture-of-experts model (tiny-llama, 8
// experts, top-2, in both blocks, router_aux_loss_coef 0.05) with tensor parallelism, each
// expert's SwiGLU split over tp like the dense MLP (trainer/model/moe.h), against one process of
// the same model and global batch: every step's loss (cross-entropy plus the weighted router loss)
// and the exported weights agree to float32 reduction-order noise.
//  - tp2: the router runs on the whole tokens on both tp ranks; its gradient is summed over tp.
//  - tp2 x sequence parallelism: the tokens are gathered over tp before routing and the output
//    reduce-scattered; the engine sums the router's partial gradients with the norms'.
//  - dp2 x ep2 x tp2 (8 ranks): the experts split over ep and over tp at once.
// A checkpoint written at dp2 x ep2 x tp2 (expert shards are boxes split along the experts and
// along their widths) resumes in one process with the uninterrupted run's losses.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
using ::testing::HasSubstr;

constexpr int kSteps = 12;
constexpr char kAuxLossCoef[] = "0.05";

struct MoeTpCase {
  int dp;
  int ep;
  int tp;
  bool sp;
  int world() const { return dp * tp; }
};

std::string CaseName(const ::testing::TestParamInfo<MoeTpCase>& info) {
  const MoeTpCase& c = info.param;
  return absl::StrCat("dp", c.dp, "_ep", c.ep, "_tp", c.tp, c.sp ? "_sp" : "");
}

class MoeTensorParallelTrainingTest : public TrainerTrainingTest {
 protected:
  // Every run pins the schedule to kSteps, so that a run stopped halfway follows the same
  // learning-rate curve as the reference.
  static std::vector<std::string> MoeFlags(int steps, const std::string& dir, const MoeTpCase& c) {
    std::vector<std::string> flags = BaseFlags(steps, dir, /*decay_steps=*/kSteps);
    // Micro-batches of 4: half the passes of the fixture's 2, to keep 8 ranks on 2 cores short.
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
      if (flag == "--micro_batch=2") flag = "--micro_batch=4";
    }
    flags.push_back("--num_experts=8");
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--router_aux_loss_coef=", kAuxLossCoef));
    flags.push_back(absl::StrCat("--expert_parallel=", c.ep));
    flags.push_back(absl::StrCat("--tensor_parallel=", c.tp));
    if (c.sp) flags.push_back("--sequence_parallel");
    return flags;
  }

  // One process of the same model, exported, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-moe-tp-reference");
      std::vector<std::string> flags = MoeFlags(kSteps, *reference_dir_, {1, 1, 1, false});
      flags.push_back("--export_safetensors");
      *reference = RunTrainer(flags);
      return reference;
    }();
    return *run;
  }
  static inline std::string* reference_dir_ = new std::string;
};

class MoeTensorParallelLayoutTest : public MoeTensorParallelTrainingTest,
                                    public ::testing::WithParamInterface<MoeTpCase> {};

TEST_P(MoeTensorParallelLayoutTest, LossesAndWeightsMatchOneProcess) {
  const MoeTpCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  const std::string dir = MakeTempDir("ckpt-moe-tp");
  std::vector<std::string> flags = MoeFlags(kSteps, dir, c);
  flags.push_back("--export_safetensors");
  std::vector<TrainerRun> runs = RunRanks(flags, c.world());
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
    // The reported router loss is rank 0's last micro-batch's: one process's last micro-batch
    // when there is one data-parallel replica.
    if (c.dp > 1) continue;
    for (const auto& expected_report : reference.reports) {
      if (!expected_report.has_metrics() || expected_report.metrics().step() != step) continue;
      const double want = expected_report.metrics().router_aux_loss();
      ASSERT_GT(want, 0);
      const double aux_relative = std::abs(report.metrics().router_aux_loss() - want) / want;
      EXPECT_LE(aux_relative, 1e-4) << "router loss, step " << step;
      worst_aux = std::max(worst_aux, aux_relative);
    }
  }
  const auto weights = ReadStepExport(dir, kSteps);
  const auto expected_weights = ReadStepExport(*reference_dir_, kSteps);
  ASSERT_TRUE(expected_weights.contains("layers.1.mlp.experts.down"));
  ASSERT_TRUE(expected_weights.contains("layers.0.mlp.router.weight"));
  const double weight_difference = MaxRelativeDifference(weights, expected_weights);
  std::cout << CaseName({c, 0}) << ": max relative loss difference " << worst_loss
            << ", router loss " << worst_aux << ", max relative weight difference "
            << weight_difference << "\n";
  EXPECT_LE(weight_difference, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeTensorParallelLayoutTest,
                         ::testing::Values(MoeTpCase{1, 1, 2, false}, MoeTpCase{1, 1, 2, true},
                                           MoeTpCase{2, 2, 2, false}),
                         CaseName);

// Saved at dp2 x ep2 x tp2, resumed at dp1 x tp1: the expert shards are boxes of the logical
// [experts, out, in] tensors cut along the experts and along the tp-split width, which one
// process reads back whole.
TEST_F(MoeTensorParallelTrainingTest, CheckpointAtEp2Tp2ResumesInOneProcess) {
  const int n = kSteps / 2;
  const TrainerRun& straight = Reference();
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-moe-tp-resume");
  const MoeTpCase saved{2, 2, 2, false};
  std::vector<TrainerRun> first = RunRanks(MoeFlags(n, dir, saved), saved.world());
  ASSERT_EQ(first.size(), static_cast<size_t>(saved.world()));
  for (int rank = 0; rank < saved.world(); ++rank) {
    ASSERT_EQ(first[rank].exit_code, 0) << "rank " << rank << ":\n" << first[rank].output;
  }
  const TrainerRun resumed = RunTrainer(MoeFlags(kSteps, dir, {1, 1, 1, false}));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(kSteps - n));
  for (int64_t step = n + 1; step <= kSteps; ++step) {
    const double expected = straight.losses.at(step);
    EXPECT_LE(std::abs(resumed.losses.at(step) - expected) / expected, 1e-4) << "step " << step;
  }
}

}  // namespace
}  // namespace tessera
