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
#include "gtest/gtest.h"
#include "tests/trainer_layout_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::LayoutTrainingTest;
using ::tessera::testing::TrainerRun;

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
class MoeTrainingTest : public LayoutTrainingTest {
 protected:
  static std::vector<std::string> MoeFlags(int steps, const std::string& dir, int ep, int zero,
                                           int decay_steps) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    UseTinyMoe(flags, /*aux_loss_coef=*/"0");
    flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", ep));
    flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", zero));
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
  static const Reference& OneProcess() {
    static const Reference& reference = []() -> const Reference& {
      const Reference& run = SuiteReference("ckpt-moe-reference", [](const std::string& dir) {
        std::vector<std::string> flags = MoeFlags(kSteps, dir, 1, 0, 0);
        flags.push_back("--set=checkpoint.export_safetensors=true");
        return flags;
      });
      std::cout << "ep1 (one process): median step " << MedianStepSeconds(run.run) << " s\n";
      return run;
    }();
    return reference;
  }
};

TEST_P(ExpertParallelTrainingTest, LossesAndWeightsMatchOneProcess) {
  const ExpertCase& c = GetParam();
  const std::string dir = MakeTempDir("ckpt-moe-ep");
  std::vector<std::string> flags = MoeFlags(kSteps, dir, c.ep, c.zero, 0);
  flags.push_back("--set=checkpoint.export_safetensors=true");
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutTrainsLike(OneProcess(), flags, dir,
                                                 {.world = c.dp,
                                                  .steps = kSteps,
                                                  .tolerance = 1e-4,
                                                  .expected_tensors = {"layers.0.mlp.experts.gate"},
                                                  .name = CaseName({c, 0})},
                                                 &runs));
  std::cout << CaseName({c, 0}) << ": median step " << MedianStepSeconds(runs[0]) << " s\n";
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
  const std::string saved = MakeTempDir("ckpt-moe-saved");
  std::vector<TrainerRun> first;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(MoeFlags(n, saved, 2, 1, 2 * n), 2, &first));
  for (const auto& [resumed_dp, resumed_ep] : {std::pair{1, 1}, std::pair{4, 4}}) {
    SCOPED_TRACE(absl::StrCat("resumed at dp", resumed_dp, " ep", resumed_ep));
    const std::string dir = MakeTempDir("ckpt-moe-resume");
    const std::string copy = absl::StrCat("cp -r ", saved, "/. ", dir);
    ASSERT_EQ(std::system(copy.c_str()), 0);
    std::vector<TrainerRun> resumed;
    ASSERT_NO_FATAL_FAILURE(
        RunRanksToSuccess(MoeFlags(2 * n, dir, resumed_ep, 1, 2 * n), resumed_dp, &resumed));
    ExpectResumedLike(resumed[0], straight, n, 2 * n, 1e-4);
  }
}

}  // namespace
}  // namespace tessera
