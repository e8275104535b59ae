// Real tessera-trainer processes fine-tuning LoRA adapters on a tiny mixture-of-experts model
// (tiny-llama with 8 experts, top-2, every linear layer adapted, the experts' projections one
// adapter pair per expert) with expert parallelism against one process of the same model. The
// experts' adapters are sharded like the experts and their gradients reduced over edp; the
// attention's are replicated and reduced over dp. dp2 x ep2 (ZeRO 0) and dp4 x ep2 (ZeRO 1, edp
// 2) see the same global batch, so every step's loss and the final PEFT adapter (gathered from
// the ep ranks into PEFT's per-expert names) agree with one process to float32 reduction-order
// noise. An adapter-only checkpoint written at ep 2 resumes in one process with the
// uninterrupted run's losses. QLoRA with the experts in NF4 tracks LoRA and runs at ep 2.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/trainer_layout_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::LayoutTrainingTest;
using ::tessera::testing::TrainerRun;
using ::testing::HasSubstr;

constexpr int kSteps = 12;
constexpr int kExperts = 8;

struct LoraCase {
  int dp;
  int ep;
  int zero;
};

std::string CaseName(const ::testing::TestParamInfo<LoraCase>& info) {
  return absl::StrCat("dp", info.param.dp, "_ep", info.param.ep, "_zero", info.param.zero);
}

class MoeLoraTrainingTest : public LayoutTrainingTest {
 protected:
  static std::vector<std::string> Flags(int steps, const std::string& dir, int ep, int zero,
                                        int decay_steps) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    UseTinyMoe(flags, /*aux_loss_coef=*/"0");
    flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", ep));
    flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", zero));
    flags.push_back("--set=lora.rank=4");
    return flags;
  }

  // One process of the same job, once for the suite.
  static const Reference& OneProcess() {
    return SuiteReference("moe-lora-reference",
                          [](const std::string& dir) { return Flags(kSteps, dir, 1, 0, 0); });
  }
};

class MoeLoraLayoutTest : public MoeLoraTrainingTest,
                          public ::testing::WithParamInterface<LoraCase> {};

TEST_P(MoeLoraLayoutTest, LossesAndAdaptersMatchOneProcess) {
  const LoraCase& c = GetParam();
  const std::string dir = MakeTempDir("moe-lora-ep");
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutTrainsLike(
      OneProcess(), Flags(kSteps, dir, c.ep, c.zero, 0), dir,
      {.world = c.dp,
       .steps = kSteps,
       .tolerance = 1e-4,
       .adapters = true,
       .expected_tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"},
       .name = CaseName({c, 0})},
      &runs));
  EXPECT_LT(runs[0].losses.at(kSteps), runs[0].losses.at(1));

  const auto adapter = ReadStepAdapter(dir, kSteps);
  // Every expert of every layer has its own pair in the gathered file, also those this rank
  // did not hold, and they trained (B starts at zero). tiny-llama has no qk_norm, so PEFT's names
  // are Mixtral's (w1, w3, w2 for gate, up, down).
  for (int e = 0; e < kExperts; ++e) {
    for (const char* projection : {"w1", "w3", "w2"}) {
      const std::string b =
          absl::StrCat("base_model.model.model.layers.1.block_sparse_moe.experts.", e, ".",
                       projection, ".lora_B.weight");
      ASSERT_TRUE(adapter.contains(b)) << b;
      EXPECT_TRUE(
          std::any_of(adapter.at(b).begin(), adapter.at(b).end(), [](float v) { return v != 0; }))
          << b << " did not train";
    }
  }
  ASSERT_TRUE(adapter.contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  // 2 layers x (4 attention projections + 8 experts x 3) x A and B.
  EXPECT_EQ(adapter.size(), 2u * (4 + kExperts * 3) * 2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLoraLayoutTest,
                         ::testing::Values(LoraCase{2, 2, 0}, LoraCase{4, 2, 1}), CaseName);

// Saved at dp2 x ep2 (each rank's experts' adapters a box of the logical stacks), resumed in one
// process holding every expert.
TEST_F(MoeLoraTrainingTest, CheckpointAtExpertParallelResumesInOneProcess) {
  const int n = kSteps / 2;
  const TrainerRun straight = RunTrainer(Flags(kSteps, "", 1, 0, kSteps));
  const std::string dir = MakeTempDir("moe-lora-resume");
  std::vector<TrainerRun> first;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(Flags(n, dir, 2, 0, kSteps), 2, &first));
  const TrainerRun resumed = RunTrainer(Flags(kSteps, dir, 1, 0, kSteps));
  ExpectResumedLike(resumed, straight, n, kSteps, 1e-4);
}

// QLoRA on the experts (--lora_nf4): the attention's and every expert's frozen weights in NF4.
// One process tracks plain LoRA's losses within NF4's error (the dense QLoRA test's tolerance),
// and dp2 x ep2 (each rank quantizing its own experts, which quantize alike whatever the split)
// equals one process's QLoRA run.
TEST_F(MoeLoraTrainingTest, QloraOnExpertsTracksLoraAndRunsExpertParallel) {
  const TrainerRun& lora = OneProcess().run;
  ASSERT_EQ(lora.exit_code, 0) << lora.output;
  std::vector<std::string> flags = Flags(kSteps, "", 1, 0, 0);
  flags.push_back("--set=lora.base_quantization=LORA_BASE_QUANTIZATION_NF4");
  const TrainerRun qlora = RunTrainer(flags);
  ASSERT_EQ(qlora.exit_code, 0) << qlora.output;
  EXPECT_THAT(qlora.output, HasSubstr("(block linear weights in NF4)"));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(qlora, lora, 1, kSteps, 1e-2, &worst));
  EXPECT_GT(worst, 0) << "QLoRA's losses equal LoRA's: is the base really quantized?";
  EXPECT_LT(qlora.losses.at(kSteps), qlora.losses.at(1));

  std::vector<std::string> ep_flags = Flags(kSteps, "", 2, 0, 0);
  ep_flags.push_back("--set=lora.base_quantization=LORA_BASE_QUANTIZATION_NF4");
  std::vector<TrainerRun> ranks;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(ep_flags, 2, &ranks));
  ExpectLossesMatch(ranks[0], qlora, 1, kSteps, 1e-4);
  std::cout << "MoE QLoRA vs LoRA on tiny-llama with 8 experts, largest relative loss difference "
               "over "
            << kSteps << " steps: " << worst << "\n";
}

}  // namespace
}  // namespace tessera
