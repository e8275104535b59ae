// Real tessera-trainer processes under interleaved 1F1B (pipeline_virtual_stages > 1) against
// one process of the same model: GPT-2 style (tied embeddings: stage 0's first chunk embeds, the
// last stage's last chunk reuses the embedding as its head) and Llama style (untied head), alone
// and with data parallelism and ZeRO-1. Every step's loss, the evaluations and the exported
// weights agree to float32 reduction-order noise; a checkpoint written under virtual stages
// resumes under plain 1F1B; and the layouts the schedule cannot run are refused naming the field.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::Evals;
using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
using ::testing::HasSubstr;

// Four layers: pp 2 x v 2 gives each chunk one layer, stage 0 layers 0 and 2, stage 1 layers 1
// and 3 (the activations wrap from stage 1 back to stage 0 between chunks).
constexpr int kLayers = 4;

struct InterleavedCase {
  std::string name;
  std::string preset;
  int dp;
  int zero;
  std::string recompute = "none";
};

class InterleavedPipelineTest : public TrainerTrainingTest,
                                public ::testing::WithParamInterface<InterleavedCase> {
 protected:
  static constexpr int kSteps = 12;

  static std::vector<std::string> ModelFlags(const std::string& dir, const std::string& preset,
                                             int steps = kSteps, int decay_steps = 0) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    for (auto& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=" + preset;
    }
    ChangeModelDims(flags, [](v1::ModelDims& dims) { dims.set_num_layers(kLayers); });
    flags.push_back("--set=checkpoint.export_safetensors=true");
    flags.push_back(Shards("data.validation_shards", *data_dir_ + "/val-*.bin"));
    flags.push_back("--set=data.eval_interval_steps=6");
    flags.push_back("--set=data.eval_batches=2");
    return flags;
  }

  // One process of the preset, once per preset for the suite; sets its checkpoint dir.
  static const TrainerRun& Reference(const std::string& preset, std::string* dir) {
    static auto* runs = new std::map<std::string, std::pair<std::string, TrainerRun>>;
    auto it = runs->find(preset);
    if (it == runs->end()) {
      const std::string reference_dir = MakeTempDir("ckpt-vpp-reference");
      it = runs->emplace(preset, std::make_pair(reference_dir,
                                                RunTrainer(ModelFlags(reference_dir, preset))))
               .first;
    }
    *dir = it->second.first;
    return it->second.second;
  }
};

TEST_P(InterleavedPipelineTest, LossesAndWeightsMatchOneProcess) {
  const InterleavedCase& c = GetParam();
  std::string reference_dir;
  const TrainerRun& reference = Reference(c.preset, &reference_dir);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string dir = MakeTempDir("ckpt-vpp");
  std::vector<std::string> flags = ModelFlags(dir, c.preset);
  flags.push_back("--set=parallelism.layout.pipeline_parallel=2");
  flags.push_back("--set=parallelism.layout.pipeline_virtual_stages=2");
  flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", c.zero));
  flags.push_back(Recompute(c.recompute));
  const int world = 2 * c.dp;
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags, world, &runs));
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("dp 0/", c.dp, ", tp 0/1, pp 0/2")));
  EXPECT_THAT(runs[0].output, HasSubstr("2 virtual stages"));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(runs[0], reference, 1, kSteps, 1e-5, &worst));
  // Evaluation goes around the stages once per chunk; eval_batches are per dp rank, so only
  // dp 1 evaluates the reference's samples.
  if (c.dp == 1) ExpectEvalsMatch(runs[0], reference, 2, 1e-5);
  const double weights =
      MaxRelativeDifference(ReadStepExport(dir, kSteps), ReadStepExport(reference_dir, kSteps));
  std::cout << c.name << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  EXPECT_LE(weights, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, InterleavedPipelineTest,
    ::testing::Values(InterleavedCase{"gpt2_pp2_v2", "tiny-gpt2", 1, 0},
                      InterleavedCase{"gpt2_pp2_v2_dp2_zero1", "tiny-gpt2", 2, 1},
                      InterleavedCase{"llama_pp2_v2", "tiny-llama", 1, 0, "full"},
                      InterleavedCase{"llama_pp2_v2_dp2", "tiny-llama", 2, 0}),
    [](const ::testing::TestParamInfo<InterleavedCase>& info) { return info.param.name; });

// A checkpoint does not depend on the chunks: saved at pp 2 x v 2 after n steps, resumed at
// pp 2 x v 1 (each stage two consecutive layers) for n more, the losses are those of one process
// that never stopped.
TEST_F(InterleavedPipelineTest, CheckpointResumesWithoutVirtualStages) {
  const int n = 6;
  std::string unused;
  const TrainerRun straight = RunTrainer(ModelFlags("", "tiny-gpt2", 2 * n, 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-vpp-resume");
  auto flags = [&](int steps, int virtual_stages) {
    std::vector<std::string> f = ModelFlags(dir, "tiny-gpt2", steps, 2 * n);
    f.push_back("--set=parallelism.layout.pipeline_parallel=2");
    f.push_back(absl::StrCat("--set=parallelism.layout.pipeline_virtual_stages=", virtual_stages));
    return f;
  };
  std::vector<TrainerRun> first;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags(n, 2), 2, &first));
  ExpectLossesMatch(first[0], straight, 1, n, 1e-5);
  std::vector<TrainerRun> resumed;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags(2 * n, 1), 2, &resumed));
  ExpectResumedLike(resumed[0], straight, n, 2 * n, 1e-5);
}

// What the interleaved schedule cannot run fails at start, naming the field.
TEST_F(InterleavedPipelineTest, LayoutsTheScheduleCannotRunAreRefused) {
  struct Refusal {
    int world;
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<Refusal> refusals = {
      // pp 1: nothing to interleave.
      {1,
       {"--set=parallelism.layout.pipeline_virtual_stages=2"},
       "pipeline_virtual_stages: 2 needs pipeline_parallel > 1"},
      // 4 layers over pp 2: 2 per stage, not 3 chunks.
      {2,
       {"--set=parallelism.layout.pipeline_parallel=2",
        "--set=parallelism.layout.pipeline_virtual_stages=3"},
       "pipeline_virtual_stages: 3 does not divide the 2 layers"},
      // 6 sequences of 2: 3 micro-batches, not a multiple of pp 2 (the message of the rules
      // table the coordinator applies at submission, planner/layout_rules.h).
      {2,
       {"--set=parallelism.layout.pipeline_parallel=2",
        "--set=parallelism.layout.pipeline_virtual_stages=2", "--set=batch.global_batch_size=6"},
       "needs the micro-batches per step (3 = global batch / (micro-batch x data_parallel)) to be "
       "a multiple of pipeline_parallel 2"},
  };
  for (const Refusal& refusal : refusals) {
    std::vector<std::string> flags = ModelFlags("", "tiny-gpt2", 2);
    for (const std::string& flag : refusal.flags) flags.push_back(flag);
    const std::vector<TrainerRun> runs = RunRanks(flags, refusal.world);
    ASSERT_EQ(runs.size(), static_cast<size_t>(refusal.world));
    EXPECT_NE(runs[0].exit_code, 0) << runs[0].output;
    EXPECT_THAT(runs[0].output, HasSubstr("parallelism.layout.pipeline_virtual_stages"));
    EXPECT_THAT(runs[0].output, HasSubstr(refusal.message));
    EXPECT_TRUE(runs[0].losses.empty()) << runs[0].output;
  }
}

}  // namespace
}  // namespace tessera
