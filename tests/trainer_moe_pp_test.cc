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

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/trainer_layout_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::LayoutTrainingTest;

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

class MoePipelineTrainingTest : public LayoutTrainingTest,
                                public ::testing::WithParamInterface<MoePipelineCase> {
 protected:
  static std::vector<std::string> MoeFlags(const std::string& dir, const MoePipelineCase& c) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    UseTinyMoe(flags, kAuxLossCoef);
    ChangeModelDims(flags, [](v1::ModelDims& dims) { dims.set_num_layers(kLayers); });
    flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", c.ep));
    flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", c.tp));
    flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", c.pp));
    flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_virtual_stages=", c.v));
    flags.push_back("--set=checkpoint.export_safetensors=true");
    return flags;
  }

  static const Reference& OneProcess() {
    return SuiteReference("ckpt-moe-pp-reference",
                          [](const std::string& dir) { return MoeFlags(dir, {1, 1, 1, 1, 1}); });
  }
};

TEST_P(MoePipelineTrainingTest, LossesRouterLossAndWeightsMatchOneProcess) {
  const MoePipelineCase& c = GetParam();
  const std::string dir = MakeTempDir("ckpt-moe-pp");
  // With two data-parallel replicas rank 0 reports its own micro-batches' router loss.
  ExpectLayoutTrainsLike(
      OneProcess(), MoeFlags(dir, c), dir,
      {.world = c.world(),
       .steps = kSteps,
       .tolerance = 1e-5,
       .compare_router_loss = c.dp == 1,
       .expected_tensors = {"layers.3.mlp.experts.down", "layers.2.mlp.router.weight"},
       .name = CaseName({c, 0})});
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
