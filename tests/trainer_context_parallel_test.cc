// Context parallelism in real tessera-trainer processes against one process of the same
// model: the cp ranks of a replica read the same samples, keep their two load-balanced chunks of
// every sequence and attend over the whole sequence through ring attention, so the 12 losses,
// the evaluations and the exported weights agree with the single process to float32 reduction
// noise. Covered: GPT-2 (learned positions) and Llama (rotary, grouped-query attention) at cp 2
// and 4, with tensor (and sequence) parallelism, data parallelism and ZeRO, pipeline stages,
// recomputation, loss-masked data, LoRA; a checkpoint saved at cp 2 resumed at cp 1 and at dp 2;
// and the refusals.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <ostream>
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

constexpr int kSteps = 12;

struct ContextCase {
  std::string name;
  std::string preset;
  int cp;
  int dp = 1;
  int tp = 1;
  int pp = 1;
  bool sp = false;
  int zero = 0;
  std::string recompute = "none";
  bool masked = false;  // instruction data with a loss mask instead of the plain corpus
  int lora_rank = 0;    // LoRA adapters on a frozen base (the reference has them too)
};

class ContextParallelTest : public TrainerTrainingTest,
                            public ::testing::WithParamInterface<ContextCase> {
 protected:
  // Instruction data whose loss mask counts only the replies: the counted targets fall unevenly
  // on the cp ranks' chunks, which the loss weighting must see.
  static const std::string& MaskedDataDir() {
    static std::string* dir = nullptr;
    if (dir == nullptr) {
      dir = new std::string(MakeTempDir("cp-sft"));
      std::ofstream file(*dir + "/chat.jsonl");
      for (int i = 0; i < 240; ++i) {
        std::string reply;
        for (int j = 0; j < 1 + (i * 7) % 30; ++j) reply += static_cast<char>('a' + (i + j) % 26);
        file << "{\"messages\": [{\"role\": \"user\", \"content\": \"echo " << i % 17
             << "\"}, {\"role\": \"assistant\", \"content\": \"" << reply << "\"}]}\n";
      }
      file.close();
      auto prepared =
          RunCommand({Trainer(), "prepare", "--input=" + *dir + "/chat.jsonl",
                      "--output_dir=" + *dir, "--sample_seq_len=64", "--val_fraction=0.1"});
      EXPECT_THAT(prepared, IsOk());
      if (prepared.ok()) {
        EXPECT_EQ(prepared->exit.exit_code, 0) << prepared->output;
        EXPECT_THAT(prepared->output, HasSubstr("with a loss mask"));
      }
    }
    return *dir;
  }

  static std::vector<std::string> Flags(const std::string& dir, const std::string& preset,
                                        bool masked, int lora_rank) {
    std::vector<std::string> flags = BaseFlags(kSteps, dir);
    const std::string data = masked ? MaskedDataDir() : *data_dir_;
    for (auto& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=" + preset;
      if (flag.starts_with("--set=data.train_shards="))
        flag = Shards("data.train_shards", data + "/train-*.bin");
    }
    flags.push_back("--set=checkpoint.export_safetensors=true");
    flags.push_back(Shards("data.validation_shards", data + "/val-*.bin"));
    flags.push_back("--set=data.eval_interval_steps=6");
    flags.push_back("--set=data.eval_batches=3");
    if (lora_rank > 0) flags.push_back(absl::StrCat("--set=lora.rank=", lora_rank));
    return flags;
  }

  // One process of the model, once per model and data for the suite; `dir` gets its checkpoints.
  static const TrainerRun& Reference(const std::string& preset, bool masked, int lora_rank,
                                     std::string* dir) {
    static auto* runs = new std::map<std::string, std::pair<std::string, TrainerRun>>;
    const std::string key = absl::StrCat(preset, masked ? "/masked" : "", "/lora", lora_rank);
    auto it = runs->find(key);
    if (it == runs->end()) {
      const std::string reference_dir = MakeTempDir("cp-reference");
      it = runs->emplace(key, std::make_pair(reference_dir, RunTrainer(Flags(reference_dir, preset,
                                                                             masked, lora_rank))))
               .first;
    }
    *dir = it->second.first;
    return it->second.second;
  }
};

// step -> the gradient norm rank 0 reported.
std::map<int64_t, double> GradNorms(const TrainerRun& run) {
  std::map<int64_t, double> norms;
  for (const auto& report : run.reports) {
    if (report.has_metrics()) norms[report.metrics().step()] = report.metrics().grad_norm();
  }
  return norms;
}

std::string CaseName(const ::testing::TestParamInfo<ContextCase>& info) { return info.param.name; }

// Names the case in test listings (ctest's) instead of dumping its bytes.
void PrintTo(const ContextCase& c, std::ostream* os) { *os << c.name; }

TEST_P(ContextParallelTest, LossesEvaluationAndWeightsMatchOneProcess) {
  const ContextCase& c = GetParam();
  std::string reference_dir;
  const TrainerRun& reference = Reference(c.preset, c.masked, c.lora_rank, &reference_dir);
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps)) << reference.output;

  const std::string dir = MakeTempDir("cp-" + c.name);
  std::vector<std::string> flags = Flags(dir, c.preset, c.masked, c.lora_rank);
  flags.push_back(absl::StrCat("--set=parallelism.layout.context_parallel=", c.cp));
  flags.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", c.tp));
  flags.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", c.pp));
  if (c.sp) flags.push_back("--set=parallelism.layout.sequence_parallel=true");
  flags.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", c.zero));
  flags.push_back(Recompute(c.recompute));
  const int world = c.dp * c.cp * c.tp * c.pp;
  std::vector<TrainerRun> runs = RunRanks(flags, world);
  ASSERT_EQ(runs.size(), static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(runs[rank].exit_code, 0) << "rank " << rank << ":\n" << runs[rank].output;
  }
  EXPECT_THAT(runs[0].output, HasSubstr(absl::StrCat("cp 0/", c.cp)));
  ASSERT_EQ(runs[0].losses.size(), static_cast<size_t>(kSteps)) << runs[0].output;
  double worst = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const double expected = reference.losses.at(step);
    ASSERT_TRUE(std::isfinite(runs[0].losses.at(step))) << "step " << step;
    const double relative = std::abs(runs[0].losses.at(step) - expected) / expected;
    EXPECT_LE(relative, 1e-4) << "step " << step;
    worst = std::max(worst, relative);
  }
  // The gradient norm counts each element once: not once per cp rank holding its replica.
  const std::map<int64_t, double> norms = GradNorms(runs[0]), expected_norms = GradNorms(reference);
  ASSERT_EQ(norms.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, norm] : norms) {
    EXPECT_LE(std::abs(norm - expected_norms.at(step)) / expected_norms.at(step), 1e-4)
        << "step " << step;
  }
  // eval_batches are per dp rank: with dp 1 the cp ranks together evaluate the reference's
  // samples, each of its tokens counted once.
  if (c.dp == 1) ExpectEvalsMatch(runs[0], reference, 2, 1e-4);
  const double weights =
      MaxRelativeDifference(ReadStepExport(dir, kSteps), ReadStepExport(reference_dir, kSteps));
  std::cout << c.name << ": max relative loss difference " << worst
            << ", max relative weight difference " << weights << "\n";
  EXPECT_LE(weights, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ContextParallelTest,
    ::testing::Values(
        ContextCase{.name = "gpt2_cp2", .preset = "tiny-gpt2", .cp = 2},
        ContextCase{.name = "llama_cp2", .preset = "tiny-llama", .cp = 2},
        ContextCase{.name = "gpt2_cp4", .preset = "tiny-gpt2", .cp = 4},
        ContextCase{.name = "llama_cp4", .preset = "tiny-llama", .cp = 4},
        ContextCase{.name = "llama_cp2_tp2", .preset = "tiny-llama", .cp = 2, .tp = 2},
        ContextCase{.name = "gpt2_cp2_tp2_sp", .preset = "tiny-gpt2", .cp = 2, .tp = 2, .sp = true},
        ContextCase{
            .name = "gpt2_cp2_dp2_zero1", .preset = "tiny-gpt2", .cp = 2, .dp = 2, .zero = 1},
        ContextCase{
            .name = "llama_cp2_dp2_zero3", .preset = "tiny-llama", .cp = 2, .dp = 2, .zero = 3},
        ContextCase{.name = "gpt2_cp2_pp2", .preset = "tiny-gpt2", .cp = 2, .pp = 2},
        ContextCase{.name = "llama_cp2_pp2", .preset = "tiny-llama", .cp = 2, .pp = 2},
        ContextCase{.name = "llama_cp2_full_recompute",
                    .preset = "tiny-llama",
                    .cp = 2,
                    .recompute = "full"},
        ContextCase{.name = "gpt2_cp2_selective_recompute",
                    .preset = "tiny-gpt2",
                    .cp = 2,
                    .recompute = "selective"},
        ContextCase{.name = "llama_cp2_masked", .preset = "tiny-llama", .cp = 2, .masked = true},
        ContextCase{.name = "llama_cp2_lora", .preset = "tiny-llama", .cp = 2, .lora_rank = 4}),
    CaseName);

// A checkpoint is layout-free: 6 steps at cp 2, then on at cp 1 (and, from a copy, at dp 2) from
// its checkpoint, equal the 12 steps of one uninterrupted process (the schedule pinned to 12
// steps in both halves).
TEST_F(TrainerTrainingTest, CheckpointSavedAtContextParallelTwoResumesAtOneAndAtDataTwo) {
  auto llama = [](std::vector<std::string> flags) {
    for (auto& flag : flags) {
      if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=tiny-llama";
    }
    return flags;
  };
  const TrainerRun straight = RunTrainer(llama(BaseFlags(kSteps, "", kSteps)));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  ASSERT_EQ(straight.losses.size(), static_cast<size_t>(kSteps));

  const std::string dir = MakeTempDir("cp-resume");
  std::vector<std::string> first_flags = llama(BaseFlags(kSteps / 2, dir, kSteps));
  first_flags.push_back("--set=parallelism.layout.context_parallel=2");
  std::vector<TrainerRun> first = RunRanks(first_flags, 2);
  ASSERT_EQ(first.size(), 2u);
  for (const TrainerRun& run : first) ASSERT_EQ(run.exit_code, 0) << run.output;
  for (int64_t step = 1; step <= kSteps / 2; ++step) {
    EXPECT_LE(
        std::abs(first[0].losses.at(step) - straight.losses.at(step)) / straight.losses.at(step),
        1e-4)
        << "step " << step;
  }

  // The same checkpoint resumed at dp 2 too, from a copy (a resume saves into its directory).
  const std::string dp_dir = MakeTempDir("cp-resume-dp");
  std::filesystem::copy(
      dir, dp_dir,
      std::filesystem::copy_options::recursive | std::filesystem::copy_options::overwrite_existing);
  TrainerRun resumed = RunTrainer(llama(BaseFlags(kSteps, dir, kSteps)));
  std::vector<TrainerRun> resumed_dp = RunRanks(llama(BaseFlags(kSteps, dp_dir, kSteps)), 2);
  ASSERT_EQ(resumed_dp.size(), 2u);
  EXPECT_THAT(resumed.output,
              HasSubstr(absl::StrCat("resumed from ", dir, "/step-0000000", kSteps / 2)));
  EXPECT_THAT(resumed_dp[0].output,
              HasSubstr(absl::StrCat("resumed from ", dp_dir, "/step-0000000", kSteps / 2)));
  EXPECT_THAT(resumed_dp[0].output, HasSubstr("dp 0/2"));
  for (const TrainerRun* run : {&resumed, &resumed_dp[0], &resumed_dp[1]}) {
    ASSERT_EQ(run->exit_code, 0) << run->output;
  }
  for (const TrainerRun* run : {&resumed, &resumed_dp[0]}) {
    ASSERT_EQ(run->losses.size(), static_cast<size_t>(kSteps / 2)) << run->output;
    for (int64_t step = kSteps / 2 + 1; step <= kSteps; ++step) {
      EXPECT_LE(
          std::abs(run->losses.at(step) - straight.losses.at(step)) / straight.losses.at(step),
          1e-4)
          << "step " << step;
    }
  }
}

// A sequence that does not cut into 2 x cp equal chunks is refused before any rank trains, with
// the fields named; so is packed data, whose records ring attention cannot keep apart.
TEST_F(TrainerTrainingTest, ContextParallelRefusesWhatItCannotSplit) {
  std::vector<std::string> flags = BaseFlags(2);
  for (auto& flag : flags) {
    if (flag == "--set=data.seq_len=64") flag = "--set=data.seq_len=66";
  }
  flags.push_back("--set=parallelism.layout.context_parallel=2");
  std::vector<TrainerRun> runs = RunRanks(flags, 2);
  ASSERT_EQ(runs.size(), 2u);
  for (const TrainerRun& run : runs) {
    EXPECT_NE(run.exit_code, 0) << run.output;
    // The rules table's message, as SubmitJob gives it (planner/layout_rules.h).
    EXPECT_THAT(run.output, HasSubstr("parallelism.layout.context_parallel: 2: 2 x "
                                      "context_parallel (4) does not divide data.seq_len 66"));
    EXPECT_TRUE(run.losses.empty());
  }

  const std::string packed = MakeTempDir("cp-packed");
  {
    std::ofstream file(packed + "/docs.jsonl");
    for (int i = 0; i < 120; ++i) file << "{\"text\": \"document " << i << " of a few words\"}\n";
  }
  auto prepared =
      RunCommand({Trainer(), "prepare", "--input=" + packed + "/docs.jsonl",
                  "--output_dir=" + packed, "--sample_seq_len=64", "--pack", "--val_fraction=0"});
  ASSERT_THAT(prepared, IsOk());
  ASSERT_EQ(prepared->exit.exit_code, 0) << prepared->output;
  flags = BaseFlags(2);
  for (auto& flag : flags) {
    if (flag.starts_with("--set=data.train_shards="))
      flag = Shards("data.train_shards", packed + "/train-*.bin");
  }
  flags.push_back("--set=parallelism.layout.context_parallel=2");
  runs = RunRanks(flags, 2);
  ASSERT_EQ(runs.size(), 2u);
  for (const TrainerRun& run : runs) {
    EXPECT_NE(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("data.train_shards: the shards pack several records"));
    EXPECT_TRUE(run.losses.empty());
  }
}

}  // namespace
}  // namespace tessera
