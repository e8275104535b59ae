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

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/trainer_layout_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::LayoutTrainingTest;

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

class MoeLayoutTrainingTest : public LayoutTrainingTest,
                              public ::testing::WithParamInterface<MoeLayoutCase> {
 protected:
  static std::vector<std::string> MoeFlags(const std::string& dir, const MoeLayoutCase& c) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    UseTinyMoe(flags, kAuxLossCoef);
    flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", c.ep));
    flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", c.pp));
    flags.push_back("--set=checkpoint.export_safetensors=true");
    return flags;
  }

  static const Reference& OneProcess() {
    return SuiteReference("ckpt-moe-layouts-reference",
                          [](const std::string& dir) { return MoeFlags(dir, {1, 1, 1}); });
  }
};

TEST_P(MoeLayoutTrainingTest, LossesAndWeightsMatchOneProcess) {
  const MoeLayoutCase& c = GetParam();
  const std::string dir = MakeTempDir("ckpt-moe-layout");
  // The reported router loss is the last micro-batch's on rank 0, which one process's last
  // micro-batch equals under pipeline parallelism alone (the stages' shares summed); a
  // data-parallel rank 0 sees other micro-batches.
  ExpectLayoutTrainsLike(
      OneProcess(), MoeFlags(dir, c), dir,
      {.world = c.world(),
       .steps = kSteps,
       .tolerance = 1e-4,
       .compare_router_loss = c.dp == 1,
       .expected_tensors = {"layers.1.mlp.experts.gate", "layers.0.mlp.router.weight"},
       .name = CaseName({c, 0})});
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLayoutTrainingTest,
                         ::testing::Values(MoeLayoutCase{1, 1, 2}, MoeLayoutCase{2, 2, 2},
                                           MoeLayoutCase{2, 2, 1}),
                         CaseName);

}  // namespace
}  // namespace tessera
