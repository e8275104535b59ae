// Real tessera-trainer processes fine-tuning LoRA adapters under tensor parallelism (adapters split
// like their base layers, trainer/model/lora.h) against one process of the same job: tiny-gpt2
// (GPT-2's fused qkv, whose B splits in three blocks, and the row-parallel projections) at tp 2,
// tp 2 with sequence parallelism and dp 2 x tp 2, and tiny-llama with 8 experts (each expert's
// adapters split like the expert's slice) at tp 2 and ep 2 x tp 2. Every step's loss and the final
// PEFT adapter (gathered over tp and ep into PEFT's whole tensors) agree with one process to
// float32 reduction-order noise. An adapter checkpoint written at tp 2 resumes in one process with
// the uninterrupted run's losses. The merged Hugging Face export (the base with the adapters
// merged in) written at ep 2 and at tp 2 equals the one-process export.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/trainer_layout_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::LayoutTrainingTest;
using ::tessera::testing::TrainerRun;
using ::testing::HasSubstr;

constexpr int kSteps = 8;

// A layout of the test and the model it trains.
struct TpCase {
  const char* name;
  bool moe;
  int dp;  // processes, as the fixture counts them (data x tensor x expert)
  int tp;
  int ep;
  bool sequence_parallel;
};

std::string CaseName(const ::testing::TestParamInfo<TpCase>& info) { return info.param.name; }

class LoraTensorParallelTest : public LayoutTrainingTest {
 protected:
  static std::vector<std::string> Flags(bool moe, int steps, const std::string& dir, int tp, int ep,
                                        bool sequence_parallel, int decay_steps = 0) {
    std::vector<std::string> flags = BaseFlags(steps, dir, decay_steps);
    if (moe) {
      UseTinyMoe(flags, /*aux_loss_coef=*/"0");
      flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", ep));
      // The default targets: every attention projection and every expert's gate, up and down.
    } else {
      // GPT-2's every linear layer: the fused qkv and fc (column-parallel), both c_proj (row).
      flags.push_back("--set=lora.target_modules=[c_attn, c_proj, c_fc]");
    }
    flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", tp));
    if (sequence_parallel) flags.push_back("--set=parallelism.layout.sequence_parallel=true");
    flags.push_back("--set=lora.rank=4");
    return flags;
  }

  // One process of the dense or the MoE job, once for the suite.
  static const Reference& OneProcess(bool moe) {
    return SuiteReference(moe ? "lora-tp-moe-reference" : "lora-tp-reference",
                          [moe](const std::string& dir) {
                            return Flags(moe, kSteps, dir, 1, 1, false);
                          });
  }
};

class LoraTensorParallelLayoutTest : public LoraTensorParallelTest,
                                     public ::testing::WithParamInterface<TpCase> {};

TEST_P(LoraTensorParallelLayoutTest, LossesAndAdaptersMatchOneProcess) {
  const TpCase& c = GetParam();
  const std::string dir = MakeTempDir("lora-tp");
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(ExpectLayoutTrainsLike(
      OneProcess(c.moe), Flags(c.moe, kSteps, dir, c.tp, c.ep, c.sequence_parallel), dir,
      {.world = c.dp,
       .steps = kSteps,
       .tolerance = 1e-5,
       .adapters = true,
       .expected_tensors = {},
       .name = c.name},
      &runs));
  EXPECT_LT(runs[0].losses.at(kSteps), runs[0].losses.at(1));
  // Every B trained (it starts at zero), also the halves a tp rank held alone.
  for (const auto& [name, values] : ReadStepAdapter(dir, kSteps)) {
    if (name.find("lora_B") == std::string::npos) continue;
    EXPECT_TRUE(std::any_of(values.begin(), values.end(), [](float v) { return v != 0; }))
        << name << " did not train";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, LoraTensorParallelLayoutTest,
                         ::testing::Values(TpCase{"gpt2_tp2", false, 2, 2, 1, false},
                                           TpCase{"gpt2_tp2_sequence_parallel", false, 2, 2, 1,
                                                  true},
                                           TpCase{"gpt2_dp2_tp2", false, 4, 2, 1, false},
                                           TpCase{"moe_tp2", true, 2, 2, 1, false},
                                           TpCase{"moe_ep2_tp2", true, 4, 2, 2, false}),
                         CaseName);

// Saved at tp 2 (each rank's split adapters boxes of the whole ones), resumed in one process.
TEST_F(LoraTensorParallelTest, CheckpointAtTensorParallelResumesInOneProcess) {
  const int n = kSteps / 2;
  const TrainerRun straight = RunTrainer(Flags(false, kSteps, "", 1, 1, false, kSteps));
  const std::string dir = MakeTempDir("lora-tp-resume");
  std::vector<TrainerRun> first;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(Flags(false, n, dir, 2, 1, false, kSteps), 2, &first));
  const TrainerRun resumed = RunTrainer(Flags(false, kSteps, dir, 1, 1, false, kSteps));
  ExpectResumedLike(resumed, straight, n, kSteps, 1e-5);
}

// QLoRA (--lora_nf4) at tp 2: each rank quantizes its own shard of the base, so where tp splits
// a weight's rows (the row-parallel projections) its 64-value blocks are not one process's, a
// difference within NF4's error: the losses track one process's QLoRA run closely, not exactly.
TEST_F(LoraTensorParallelTest, QloraAtTensorParallelTracksOneProcess) {
  std::vector<std::string> flags = Flags(false, kSteps, "", 1, 1, false);
  flags.push_back("--set=lora.base_quantization=LORA_BASE_QUANTIZATION_NF4");
  const TrainerRun one = RunTrainer(flags);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_THAT(one.output, HasSubstr("(block linear weights in NF4)"));
  std::vector<std::string> tp_flags = Flags(false, kSteps, "", 2, 1, false);
  tp_flags.push_back("--set=lora.base_quantization=LORA_BASE_QUANTIZATION_NF4");
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(tp_flags, 2, &runs));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(runs[0], one, 1, kSteps, 1e-3, &worst));
  EXPECT_LT(runs[0].losses.at(kSteps), runs[0].losses.at(1));
  std::cout << "QLoRA at tp 2 vs one process: max relative loss difference " << worst << "\n";
}

// export_merged at ep 2 and at tp 2: the base experts (and every other weight) gathered from the
// ranks with their adapters merged in, written as transformers' per-expert tensors equal to the
// one-process export. The model is a tiny Qwen3-MoE (8 experts, normalised top-k, which the
// Hugging Face export needs) made from a config.json by the trainer's own tools: its seeded
// weights exported, then written as a Hugging Face directory to import from.
TEST_F(LoraTensorParallelTest, MergedExportAtExpertAndTensorParallelEqualsOneProcess) {
  constexpr int kExportSteps = 4;
  const std::string config_dir = MakeTempDir("lora-merged-config");
  {
    std::ofstream config(config_dir + "/config.json");
    config << R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
      "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
      "norm_topk_prob": true, "max_position_embeddings": 128, "rms_norm_eps": 1e-06,
      "rope_theta": 10000.0, "tie_word_embeddings": false, "router_aux_loss_coef": 0.01})";
  }
  const std::string initial = config_dir + "/initial.safetensors";
  const TrainerRun exported =
      RunTrainer({Trainer(), Shards("data.train_shards", *data_dir_ + "/train-*.bin"),
                  Set("model.from_pretrained", config_dir), "--set=data.seq_len=64",
                  "--export_initial=" + initial});
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  const std::string source = MakeTempDir("lora-merged-source");
  const TrainerRun written =
      RunTrainer({Trainer(), Set("model.from_pretrained", config_dir), "--set=data.seq_len=64",
                  "--weights=" + initial, "--export_hf=" + source});
  ASSERT_EQ(written.exit_code, 0) << written.output;

  auto flags = [&source](const std::string& dir, int tp, int ep) {
    std::vector<std::string> flags = BaseFlags(kExportSteps, dir);
    for (std::string& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = Set("model.from_pretrained", source);
    }
    flags.push_back(absl::StrCat("--set=parallelism.layout.expert_parallel=", ep));
    flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", tp));
    flags.push_back("--set=lora.rank=4");
    flags.push_back("--set=checkpoint.export_format=EXPORT_FORMAT_HF");
    flags.push_back("--set=checkpoint.export_merged=true");
    return flags;
  };
  auto merged = [](const std::string& dir) {
    return ReadExport(dir + "/export/hf-merged/model.safetensors");
  };
  const std::string one_dir = MakeTempDir("lora-merged-one");
  const TrainerRun one = RunTrainer(flags(one_dir, 1, 1));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto expected = merged(one_dir);
  // Qwen3-MoE's names, one tensor per expert.
  ASSERT_TRUE(expected.contains("model.layers.1.mlp.experts.7.down_proj.weight"));
  const auto base = ReadExport(source + "/model.safetensors");
  ASSERT_EQ(base.size(), expected.size());
  EXPECT_GT(MaxRelativeDifference(expected, base), 0) << "no adapter was merged in";
  for (const auto& [tp, ep] : {std::pair{1, 2}, std::pair{2, 1}}) {
    const std::string dir = MakeTempDir("lora-merged");
    SCOPED_TRACE(absl::StrCat("tp ", tp, " ep ", ep));
    std::vector<TrainerRun> runs;
    ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags(dir, tp, ep), 2, &runs));
    const auto exported = merged(dir);
    ASSERT_EQ(exported.size(), expected.size()) << "tp " << tp << " ep " << ep;
    const double difference = MaxRelativeDifference(exported, expected);
    std::cout << "merged export at tp " << tp << " x ep " << ep
              << ": max relative difference to one process " << difference << "\n";
    EXPECT_LE(difference, 1e-5) << "tp " << tp << " ep " << ep;
  }
}

}  // namespace
}  // namespace tessera
