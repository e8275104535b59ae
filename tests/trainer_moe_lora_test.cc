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
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
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

class MoeLoraTrainingTest : public TrainerTrainingTest {
 protected:
  // One intra-op thread per trainer, as the worker pins them (WorkerOptions): QLoRA's per-expert
  // dequantization is many small ops, and on a loaded 2-core machine each op's thread-pool
  // hand-off waits for a descheduled thread (measured: 70 s a step with the default threads,
  // 1.4 s with one).
  static void SetUpTestSuite() {
    setenv("OMP_NUM_THREADS", "1", /*overwrite=*/1);
    TrainerTrainingTest::SetUpTestSuite();
  }

  static std::vector<std::string> Flags(int steps, const std::string& dir, int ep, int zero,
                                        int decay_steps) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    for (std::string& flag : flags) {
      if (flag == "--preset=tiny-gpt2") flag = "--preset=tiny-llama";
    }
    flags.push_back(absl::StrCat("--num_experts=", kExperts));
    flags.push_back("--experts_per_token=2");
    flags.push_back(absl::StrCat("--expert_parallel=", ep));
    flags.push_back(absl::StrCat("--zero_stage=", zero));
    flags.push_back("--lora_rank=4");
    return flags;
  }

  // The PEFT adapter of the final checkpoint of a run with `dir`.
  static std::map<std::string, std::vector<float>> Adapter(const std::string& dir, int step) {
    return ReadExport(absl::StrFormat("%s/step-%08d/adapter/adapter_model.safetensors", dir, step));
  }

  // One process of the same job, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("moe-lora-reference");
      *reference = RunTrainer(Flags(kSteps, *reference_dir_, 1, 0, 0));
      return reference;
    }();
    return *run;
  }
  static inline std::string* reference_dir_ = new std::string;
};

class MoeLoraLayoutTest : public MoeLoraTrainingTest,
                          public ::testing::WithParamInterface<LoraCase> {};

TEST_P(MoeLoraLayoutTest, LossesAndAdaptersMatchOneProcess) {
  const LoraCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  const std::string dir = MakeTempDir("moe-lora-ep");
  std::vector<TrainerRun> runs = RunRanks(Flags(kSteps, dir, c.ep, c.zero, 0), c.dp);
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
  EXPECT_LT(runs[0].losses.at(kSteps), runs[0].losses.at(1));

  const auto adapter = Adapter(dir, kSteps);
  const auto expected = Adapter(*reference_dir_, kSteps);
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
  const double difference = MaxRelativeDifference(adapter, expected);
  std::cout << CaseName({c, 0}) << ": max relative loss difference " << worst
            << ", max relative adapter difference " << difference << "\n";
  EXPECT_LE(difference, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLoraLayoutTest,
                         ::testing::Values(LoraCase{2, 2, 0}, LoraCase{4, 2, 1}), CaseName);

// Saved at dp2 x ep2 (each rank's experts' adapters a box of the logical stacks), resumed in one
// process holding every expert.
TEST_F(MoeLoraTrainingTest, CheckpointAtExpertParallelResumesInOneProcess) {
  const int n = kSteps / 2;
  const TrainerRun straight = RunTrainer(Flags(kSteps, "", 1, 0, kSteps));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("moe-lora-resume");
  std::vector<TrainerRun> first = RunRanks(Flags(n, dir, 2, 0, kSteps), 2);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(first[0].exit_code, 0) << first[0].output;
  ASSERT_EQ(first[1].exit_code, 0) << first[1].output;
  const TrainerRun resumed = RunTrainer(Flags(kSteps, dir, 1, 0, kSteps));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(kSteps - n));
  for (int64_t step = n + 1; step <= kSteps; ++step) {
    const double expected = straight.losses.at(step);
    EXPECT_LE(std::abs(resumed.losses.at(step) - expected) / expected, 1e-4) << "step " << step;
  }
}

// QLoRA on the experts (--lora_nf4): the attention's and every expert's frozen weights in NF4.
// One process tracks plain LoRA's losses within NF4's error (the dense QLoRA test's tolerance),
// and dp2 x ep2 (each rank quantizing its own experts, which quantize alike whatever the split)
// equals one process's QLoRA run.
TEST_F(MoeLoraTrainingTest, QloraOnExpertsTracksLoraAndRunsExpertParallel) {
  const TrainerRun& lora = Reference();
  ASSERT_EQ(lora.exit_code, 0) << lora.output;
  std::vector<std::string> flags = Flags(kSteps, "", 1, 0, 0);
  flags.push_back("--lora_nf4");
  const TrainerRun qlora = RunTrainer(flags);
  ASSERT_EQ(qlora.exit_code, 0) << qlora.output;
  EXPECT_THAT(qlora.output, HasSubstr("(block linear weights in NF4)"));
  ASSERT_EQ(qlora.losses.size(), static_cast<size_t>(kSteps));
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double relative =
        std::abs(qlora.losses.at(step) - lora.losses.at(step)) / lora.losses.at(step);
    worst = std::max(worst, relative);
    EXPECT_LT(relative, 1e-2) << "step " << step;
  }
  EXPECT_GT(worst, 0) << "QLoRA's losses equal LoRA's: is the base really quantized?";
  EXPECT_LT(qlora.losses.at(kSteps), qlora.losses.at(1));

  std::vector<std::string> ep_flags = Flags(kSteps, "", 2, 0, 0);
  ep_flags.push_back("--lora_nf4");
  std::vector<TrainerRun> ranks = RunRanks(ep_flags, 2);
  ASSERT_EQ(ranks.size(), 2u);
  ASSERT_EQ(ranks[0].exit_code, 0) << ranks[0].output;
  ASSERT_EQ(ranks[1].exit_code, 0) << ranks[1].output;
  ASSERT_EQ(ranks[0].losses.size(), static_cast<size_t>(kSteps));
  for (int64_t step = 1; step <= kSteps; ++step) {
    EXPECT_LE(std::abs(ranks[0].losses.at(step) - qlora.losses.at(step)) / qlora.losses.at(step),
              1e-4)
        << "step " << step;
  }
  std::cout << "MoE QLoRA vs LoRA on tiny-llama with 8 experts, largest relative loss difference "
               "over "
            << kSteps << " steps: " << worst << "\n";
}

}  // namespace
}  // namespace tessera
