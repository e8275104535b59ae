// Real tessera-trainer processes training a tiny mixture-of-experts model (tiny-llama with 8
// experts, top-2, in every block) with expert parallelism against one process of the same model:
// dp2 x ep2, dp4 x ep4 and dp4 x ep2 (ZeRO 0 and 1) see the same global batch, so every step's
// loss and the exported weights (the logical [num_experts, ...] tensors, gathered from the ep
// shards by the export) agree to float32 reduction-order noise. A checkpoint written at ep 2
// resumes at ep 1 and at ep 4 with the uninterrupted run's losses. The routers' aux loss is off
// here (router_aux_loss_coef 0); tests/trainer_moe_layouts_test.cc checks it on at dp2 x ep2,
// where each rank's per-micro-batch term equals one process's for the same micro-batch.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
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

struct ExpertCase {
  int dp;
  int ep;
  int zero;
};

std::string CaseName(const ::testing::TestParamInfo<ExpertCase>& info) {
  return absl::StrCat("dp", info.param.dp, "_ep", info.param.ep, "_zero", info.param.zero);
}

// The tiny MoE model's runs: flags and the median step time they report.
class MoeTrainingTest : public TrainerTrainingTest {
 protected:
  static std::vector<std::string> MoeFlags(int steps, const std::string& dir, int ep, int zero,
                                           int decay_steps) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
    }
    flags.push_back("--num_experts=8");
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--expert_parallel=", ep));
    flags.push_back(absl::StrCat("--zero_stage=", zero));
    return flags;
  }

  static double MedianStepSeconds(const TrainerRun& run) {
    std::vector<double> times;
    for (const auto& report : run.reports) {
      if (report.has_metrics() && report.metrics().step() > 1) {
        times.push_back(report.metrics().step_time_seconds());
      }
    }
    if (times.empty()) return 0;
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }
};

class ExpertParallelTrainingTest : public MoeTrainingTest,
                                   public ::testing::WithParamInterface<ExpertCase> {
 protected:
  // One process of the same model, exported, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-moe-reference");
      std::vector<std::string> flags = MoeFlags(kSteps, *reference_dir_, 1, 0, 0);
      flags.push_back("--export_safetensors");
      *reference = RunTrainer(flags);
      std::cout << "ep1 (one process): median step " << MedianStepSeconds(*reference) << " s\n";
      return reference;
    }();
    return *run;
  }
  static std::string* reference_dir_;
};

std::string* ExpertParallelTrainingTest::reference_dir_ = new std::string;

TEST_P(ExpertParallelTrainingTest, LossesAndWeightsMatchOneProcess) {
  const ExpertCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  const std::string dir = MakeTempDir("ckpt-moe-ep");
  std::vector<std::string> flags = MoeFlags(kSteps, dir, c.ep, c.zero, 0);
  flags.push_back("--export_safetensors");
  std::vector<TrainerRun> runs = RunRanks(flags, c.dp);
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.dp));
  for (int rank = 0; rank < c.dp; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps));
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = reference.losses.at(step);
    const double relative = std::abs(runs[0].losses.at(step) - expected) / expected;
    EXPECT_LE(relative, 1e-4) << "step " << step;
    worst = std::max(worst, relative);
  }
  const auto weights = ReadStepExport(dir, kSteps);
  const auto expected_weights = ReadStepExport(*reference_dir_, kSteps);
  ASSERT_TRUE(expected_weights.contains("layers.0.mlp.experts.gate"));
  const double weight_difference = MaxRelativeDifference(weights, expected_weights);
  std::cout << CaseName({c, 0}) << ": max relative loss difference " << worst
            << ", max relative weight difference " << weight_difference << ", median step "
            << MedianStepSeconds(runs[0]) << " s\n";
  EXPECT_LE(weight_difference, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ExpertParallelTrainingTest,
                         ::testing::Values(ExpertCase{2, 2, 0}, ExpertCase{4, 4, 1},
                                           ExpertCase{4, 2, 1}),
                         CaseName);

// Saved at dp2 x ep2, resumed at dp1 (ep 1) and at dp4 x ep4: the experts' shards are boxes of
// the logical tensors in the checkpoint, which any ep split reads back.
TEST_F(MoeTrainingTest, ExpertParallelCheckpointResumesAtOtherDegrees) {
  const int n = 6;
  const TrainerRun straight = RunTrainer(MoeFlags(2 * n, "", 1, 0, 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string saved = MakeTempDir("ckpt-moe-saved");
  std::vector<TrainerRun> first = RunRanks(MoeFlags(n, saved, 2, 1, 2 * n), 2);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(first[0].exit_code, 0) << first[0].output;
  ASSERT_EQ(first[1].exit_code, 0) << first[1].output;
  for (const auto& [resumed_dp, resumed_ep] : {std::pair{1, 1}, std::pair{4, 4}}) {
    SCOPED_TRACE(absl::StrCat("resumed at dp", resumed_dp, " ep", resumed_ep));
    const std::string dir = MakeTempDir("ckpt-moe-resume");
    const std::string copy = absl::StrCat("cp -r ", saved, "/. ", dir);
    ASSERT_EQ(std::system(copy.c_str()), 0);
    std::vector<TrainerRun> resumed =
        RunRanks(MoeFlags(2 * n, dir, resumed_ep, 1, 2 * n), resumed_dp);
    ASSERT_EQ(resumed.size(), static_cast<size_t>(resumed_dp));
    ASSERT_EQ(resumed[0].exit_code, 0) << resumed[0].output;
    EXPECT_THAT(resumed[0].output, HasSubstr("resumed from"));
    ASSERT_EQ(resumed[0].losses.size(), static_cast<size_t>(n));
    for (int64_t step = n + 1; step <= 2 * n; ++step) {
      const double expected = straight.losses.at(step);
      EXPECT_LE(std::abs(resumed[0].losses.at(step) - expected) / expected, 1e-4)
          << "step " << step;
    }
  }
}

}  // namespace
}  // namespace tessera
