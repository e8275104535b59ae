// Real tessera-trainer processes under parallel layouts against one process of the same model:
// ZeRO stages by activation checkpointing, tensor (with and without sequence parallelism) and
// pipeline parallelism with data parallelism, and masked or packed instruction data through
// every layout. Losses, evaluations and the exported weights agree to reduction-order noise.

#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::Evals;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
using ::testing::HasSubstr;

// ZeRO stage x activation checkpointing on dp ranks against one process without either: the same
// global batch, so every step's loss agrees to float32 reduction-order noise and so do the final
// weights (exported and gathered from the shards by the safetensors export).
struct ShardedCase {
  int dp;
  int zero;
  std::string recompute;
};

std::string CaseName(const ::testing::TestParamInfo<ShardedCase>& info) {
  return absl::StrCat("dp", info.param.dp, "_zero", info.param.zero, "_", info.param.recompute);
}

class ShardedTrainingTest : public TrainerTrainingTest,
                            public ::testing::WithParamInterface<ShardedCase> {
 protected:
  static constexpr int kSteps = 20;

  static std::vector<std::string> Flags(const std::string& dir, int zero,
                                        const std::string& recompute) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", zero));
    flags.push_back(Recompute(recompute));
    flags.push_back("--set=checkpoint.export_safetensors=true");
    return flags;
  }

  // The dp=1 run without ZeRO or recomputation, once for the suite.
  static const TrainerRun& Reference() {
    static TrainerRun* run = [] {
      auto* reference = new TrainerRun;
      *reference_dir_ = MakeTempDir("ckpt-reference");
      *reference = RunTrainer(Flags(*reference_dir_, 0, "none"));
      return reference;
    }();
    return *run;
  }
  static std::string* reference_dir_;
};

std::string* ShardedTrainingTest::reference_dir_ = new std::string;

TEST_P(ShardedTrainingTest, LossesAndWeightsMatchOneProcess) {
  const ShardedCase& c = GetParam();
  const TrainerRun& reference = Reference();
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string dir = MakeTempDir("ckpt-sharded");
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(Flags(dir, c.zero, c.recompute), c.dp, &runs));
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("ZeRO ", c.zero)));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(runs[0], reference, 1, kSteps, 1e-5, &worst));
  const double weights =
      MaxRelativeDifference(ReadStepExport(dir, kSteps), ReadStepExport(*reference_dir_, kSteps));
  std::cout << CaseName({GetParam(), 0}) << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  // Per tensor, in L2 (the key bias aside, see MaxRelativeDifference): 2-3e-7 measured.
  EXPECT_LE(weights, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    ZeroByRecompute, ShardedTrainingTest,
    ::testing::Values(ShardedCase{2, 0, "none"}, ShardedCase{2, 0, "selective"},
                      ShardedCase{2, 0, "full"}, ShardedCase{2, 1, "none"},
                      ShardedCase{2, 1, "selective"}, ShardedCase{2, 1, "full"},
                      ShardedCase{2, 2, "none"}, ShardedCase{2, 2, "selective"},
                      ShardedCase{2, 2, "full"}, ShardedCase{2, 3, "none"},
                      ShardedCase{2, 3, "selective"}, ShardedCase{2, 3, "full"},
                      ShardedCase{4, 3, "none"}, ShardedCase{4, 3, "selective"},
                      ShardedCase{4, 3, "full"}, ShardedCase{1, 3, "full"}),
    CaseName);

// Tensor (with and without sequence parallelism) and 1F1B pipeline parallelism, alone and with
// data parallelism and ZeRO-1, against one process of the same model: the same global batch, so
// the 20 losses agree to float32 reduction-order noise and so do the final weights, exported from
// the tensor-parallel and pipeline shards of the checkpoint.
struct ModelParallelCase {
  std::string name;
  int world;
  int tp;
  int pp;
  bool sp;
  int zero;
  std::string recompute;
  std::string preset;
  int layers;  // 0: the preset's
};

class ModelParallelTest : public TrainerTrainingTest,
                          public ::testing::WithParamInterface<ModelParallelCase> {
 protected:
  static constexpr int kSteps = 20;

  static std::vector<std::string> ModelFlags(const std::string& dir, const std::string& preset,
                                             int layers) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    for (auto& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=" + preset;
    }
    if (layers > 0) {
      ChangeModelDims(flags, [layers](v1::ModelDims& dims) { dims.set_num_layers(layers); });
    }
    flags.push_back("--set=checkpoint.export_safetensors=true");
    flags.push_back(Shards("data.validation_shards", *data_dir_ + "/val-*.bin"));
    flags.push_back("--set=data.eval_interval_steps=10");
    flags.push_back("--set=data.eval_batches=3");
    return flags;
  }

  // One process of the case's model, once per model for the suite; returns its checkpoint dir.
  static const TrainerRun& Reference(const std::string& preset, int layers, std::string* dir) {
    static auto* runs = new std::map<std::string, std::pair<std::string, TrainerRun>>;
    const std::string key = absl::StrCat(preset, "/", layers);
    auto it = runs->find(key);
    if (it == runs->end()) {
      const std::string reference_dir = MakeTempDir("ckpt-mp-reference");
      it = runs->emplace(key, std::make_pair(reference_dir,
                                             RunTrainer(ModelFlags(reference_dir, preset, layers))))
               .first;
    }
    *dir = it->second.first;
    return it->second.second;
  }
};

TEST_P(ModelParallelTest, LossesAndWeightsMatchOneProcess) {
  const ModelParallelCase& c = GetParam();
  std::string reference_dir;
  const TrainerRun& reference = Reference(c.preset, c.layers, &reference_dir);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  const std::string dir = MakeTempDir("ckpt-mp");
  std::vector<std::string> flags = ModelFlags(dir, c.preset, c.layers);
  flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", c.tp));
  flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", c.pp));
  if (c.sp) flags.push_back("--set=parallelism.layout.sequence_parallel=true");
  flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", c.zero));
  flags.push_back(Recompute(c.recompute));
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags, c.world, &runs));
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("dp 0/", c.world / (c.tp * c.pp), ", tp 0/",
                                                     c.tp, ", pp 0/", c.pp)));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(runs[0], reference, 1, kSteps, 1e-5, &worst));
  // Evaluation runs through the stages too, each sample counted once (eval_batches are per dp
  // rank, so only dp 1 evaluates the reference's samples).
  if (c.world == c.tp * c.pp) ExpectEvalsMatch(runs[0], reference, 2, 1e-5);
  const double weights =
      MaxRelativeDifference(ReadStepExport(dir, kSteps), ReadStepExport(reference_dir, kSteps));
  std::cout << c.name << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  // Tensor parallelism splits the products' sums (2e-6 measured); the key bias aside.
  EXPECT_LE(weights, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ModelParallelTest,
    ::testing::Values(
        ModelParallelCase{"tp2", 2, 2, 1, false, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"tp2_sp", 2, 2, 1, true, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"pp2", 2, 1, 2, false, 0, "none", "tiny-gpt2", 0},
        ModelParallelCase{"pp4", 4, 1, 4, false, 0, "none", "tiny-gpt2", 4},
        ModelParallelCase{"tp2_pp2_sp_full", 4, 2, 2, true, 0, "full", "tiny-gpt2", 0},
        ModelParallelCase{"dp2_tp2_zero1", 4, 2, 1, false, 1, "none", "tiny-llama", 0},
        ModelParallelCase{"dp2_pp2_zero1_selective", 4, 1, 2, false, 1, "selective", "tiny-gpt2",
                          0},
        ModelParallelCase{"llama_tp2_sp_selective", 2, 2, 1, true, 0, "selective", "tiny-llama", 0},
        ModelParallelCase{"llama_pp2", 2, 1, 2, false, 0, "none", "tiny-llama", 0}),
    [](const ::testing::TestParamInfo<ModelParallelCase>& info) { return info.param.name; });

// Instruction data with prompt masking (prepare --sample_seq_len): every layout that splits
// the global batch or the model (dp, tp's vocab-parallel loss, pp's last stage, and evaluation
// through them) gives one process's losses. The records' responses differ in length, so
// micro-batches and ranks hold different numbers of counted targets: a mean of per-rank means
// would differ from the global mean. Packed documents (prepare --pack, several per sample) add the
// records' positions, which every stage and rank must apply: without them on pp's second stage
// the losses differ from one process's by up to 1.6e-4.
struct MaskedLayoutCase {
  std::string name;
  int dp;
  int tp;
  int pp;
  // prepare --pack: several records per sample, kept apart by their positions.
  bool packed = false;
  bool sequence_parallel = false;
};

class MaskedTrainingTest : public TrainerTrainingTest,
                           public ::testing::WithParamInterface<MaskedLayoutCase> {
 protected:
  static constexpr int kSteps = 12;

  static const std::string& SftDir(bool packed) {
    static const std::string* dirs[2] = {nullptr, nullptr};
    const std::string*& dir = dirs[packed ? 1 : 0];
    if (dir == nullptr) {
      auto* out = new std::string(MakeTempDir(packed ? "sft-packed" : "sft"));
      const std::string jsonl = *out + "/chat.jsonl";
      std::ofstream file(jsonl);
      for (int i = 0; i < 240; ++i) {
        std::string reply;
        for (int j = 0; j < 1 + (i * 7) % 30; ++j) reply += static_cast<char>('a' + (i + j) % 26);
        if (packed) {
          // Documents of 4 to 19 tokens with their eos: three or more share a 65-token sample.
          file << "{\"text\": \"" << reply.substr(0, 3 + i % 16) << "\"}\n";
          continue;
        }
        file << "{\"messages\": [{\"role\": \"user\", \"content\": \"echo " << i % 17
             << "\"}, {\"role\": \"assistant\", \"content\": \"" << reply << "\"}]}\n";
      }
      file.close();
      std::vector<std::string> args = {Trainer(),
                                       "prepare",
                                       "--input=" + jsonl,
                                       "--output_dir=" + *out,
                                       "--sample_seq_len=64",
                                       "--val_fraction=0.1"};
      if (packed) args.push_back("--pack");
      auto prepared = RunCommand(args);
      EXPECT_THAT(prepared, IsOk());
      if (prepared.ok()) {
        EXPECT_EQ(prepared->exit.exit_code, 0) << prepared->output;
        EXPECT_THAT(prepared->output, HasSubstr("with a loss mask"));
        if (packed) {
          EXPECT_THAT(prepared->output, HasSubstr("records packed into samples"));
        }
      }
      dir = out;
    }
    return *dir;
  }

  static std::vector<std::string> MaskedFlags(const std::string& checkpoint_dir, bool packed) {
    std::vector<std::string> flags = BaseFlags(kSteps, checkpoint_dir);
    for (auto& flag : flags) {
      if (flag.starts_with("--set=data.train_shards="))
        flag = Shards("data.train_shards", SftDir(packed) + "/train-*.bin");
    }
    flags.push_back(Shards("data.validation_shards", SftDir(packed) + "/val-*.bin"));
    flags.push_back("--set=data.eval_interval_steps=6");
    flags.push_back("--set=data.eval_batches=3");
    return flags;
  }

  static const TrainerRun& Reference(bool packed) {
    static const TrainerRun* runs[2] = {nullptr, nullptr};
    const TrainerRun*& run = runs[packed ? 1 : 0];
    if (run == nullptr) {
      run = new TrainerRun(RunTrainer(MaskedFlags(MakeTempDir("sft-ref"), packed)));
    }
    return *run;
  }
};

TEST_P(MaskedTrainingTest, LossesAndEvaluationMatchOneProcess) {
  const MaskedLayoutCase& c = GetParam();
  const TrainerRun& reference = Reference(c.packed);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps)) << reference.output;
  const std::vector<v1::EvalMetrics> expected_evals = Evals(reference);
  ASSERT_EQ(expected_evals.size(), 2u) << reference.output;
  // Only response tokens count: fewer than the 3 x 2 x 64 targets of the evaluated samples.
  EXPECT_GT(expected_evals[0].tokens(), 0);
  EXPECT_LT(expected_evals[0].tokens(), 3 * 2 * 64);

  std::vector<std::string> flags = MaskedFlags(MakeTempDir("sft-" + c.name), c.packed);
  flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", c.tp));
  flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", c.pp));
  if (c.sequence_parallel) flags.push_back("--set=parallelism.layout.sequence_parallel=true");
  const int world = c.dp * c.tp * c.pp;
  std::vector<TrainerRun> runs;
  ASSERT_NO_FATAL_FAILURE(RunRanksToSuccess(flags, world, &runs));
  double worst = 0;
  ASSERT_NO_FATAL_FAILURE(ExpectLossesMatch(runs[0], reference, 1, kSteps, 2e-5, &worst));
  std::cout << "masked " << c.name << ": max relative loss difference " << worst << "\n";
  // Evaluation takes eval_batches per dp rank: only dp 1 evaluates the reference's samples.
  const std::vector<v1::EvalMetrics> evals = Evals(runs[0]);
  ASSERT_EQ(evals.size(), 2u) << runs[0].output;
  for (size_t i = 0; i < evals.size() && c.dp == 1; ++i) {
    EXPECT_EQ(evals[i].tokens(), expected_evals[i].tokens());
    EXPECT_LE(std::abs(evals[i].loss() - expected_evals[i].loss()) / expected_evals[i].loss(),
              2e-5);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, MaskedTrainingTest,
                         ::testing::Values(MaskedLayoutCase{"dp2", 2, 1, 1},
                                           MaskedLayoutCase{"tp2", 1, 2, 1},
                                           MaskedLayoutCase{"pp2", 1, 1, 2},
                                           MaskedLayoutCase{"packed_dp2", 2, 1, 1, true},
                                           MaskedLayoutCase{"packed_tp2_sp", 1, 2, 1, true, true},
                                           MaskedLayoutCase{"packed_pp2", 1, 1, 2, true}),
                         [](const ::testing::TestParamInfo<MaskedLayoutCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace tessera
