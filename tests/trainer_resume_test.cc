// Real tessera-trainer processes that save and resume: a stopped and resumed run equals an
// uninterrupted one (also across layouts: resharding dp, ZeRO, tp and pp), an asynchronous save
// killed mid-write is never resumed from, corrupted checkpoints are found by their digests and
// set aside, and a checkpoint of another model is refused naming the tensor.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/trainer_training_fixture.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::tessera::testing::TrainerRun;
using ::tessera::testing::TrainerTrainingTest;
using ::testing::HasSubstr;

TEST_F(TrainerTrainingTest, StopAndResumeEqualsAnUninterruptedRun) {
  const int n = 10;
  TrainerRun straight = RunTrainer(BaseFlags(2 * n, "", 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  // Train n steps (checkpoint at the end), stop, then train on to 2n.
  std::string dir = MakeTempDir("ckpt-resume");
  TrainerRun first = RunTrainer(BaseFlags(n, dir, 2 * n));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  for (int64_t step = 1; step <= n; ++step) {
    EXPECT_NEAR(first.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
  TrainerRun resumed = RunTrainer(BaseFlags(2 * n, dir, 2 * n));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from"));
  ASSERT_EQ(resumed.losses.size(), static_cast<size_t>(n));
  for (int64_t step = n + 1; step <= 2 * n; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
}

// Checkpoints are written in the background (AsyncCheckpointer). A process killed (SIGKILL)
// while step 6's shard is half written leaves a staging directory that resume never reads: the
// rerun resumes from step 4 and trains on exactly as an uninterrupted run.
TEST_F(TrainerTrainingTest, AnAsyncSaveKilledMidWriteIsNeverResumedFrom) {
  const int n = 8;
  TrainerRun straight = RunTrainer(BaseFlags(n, "", n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-killed");
  std::vector<std::string> flags = BaseFlags(n, dir, n);
  flags.push_back("--set=checkpoint.interval_steps=2");
  std::vector<std::string> killed = {"/usr/bin/env",
                                     absl::StrCat(kFaultKillInCheckpointAtStepEnv, "=6")};
  killed.insert(killed.end(), flags.begin(), flags.end());
  TrainerRun first = RunTrainer(killed);
  EXPECT_NE(first.exit_code, 0) << first.output;
  EXPECT_TRUE(fs::exists(dir + "/step-00000004/manifest.pb"));
  EXPECT_FALSE(fs::exists(dir + "/step-00000006"));
  TrainerRun resumed = RunTrainer(flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000004"));
  for (int64_t step = 5; step <= n; ++step) {
    EXPECT_NEAR(resumed.losses.at(step), straight.losses.at(step), 1e-5) << "step " << step;
  }
  // Every step after a save reports how long the save blocked training.
  bool reported = false;
  for (const auto& report : resumed.reports) {
    reported |= report.has_metrics() && report.metrics().step() == 7 &&
                report.metrics().checkpoint_blocked_seconds() > 0;
  }
  EXPECT_TRUE(reported) << resumed.output;
}

// Flips one byte of a checkpoint's shard file (a digest mismatch, the size unchanged).
void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(file.is_open()) << path;
  file.seekg(offset);
  char byte = 0;
  file.read(&byte, 1);
  file.seekp(offset);
  byte = static_cast<char>(~byte);
  file.write(&byte, 1);
}

// A resume verifies the digests while it loads: the corrupted newest checkpoint is loaded,
// found out, set aside as .corrupt and the older one loaded in its place, in the same process.
TEST_F(TrainerTrainingTest, CorruptedCheckpointIsSkippedByName) {
  std::string dir = MakeTempDir("ckpt-corrupt");
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--set=checkpoint.interval_steps=2");
  TrainerRun first = RunTrainer(flags);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Flip a byte in the newest checkpoint's shard.
  std::string shard = dir + "/step-00000004/rank-00000.safetensors";
  FlipByte(shard, 100);
  flags = BaseFlags(6, dir);
  TrainerRun resumed = RunTrainer(flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, HasSubstr(shard));
  EXPECT_THAT(resumed.output, HasSubstr("xxh3-128 mismatch"));
  EXPECT_THAT(resumed.output, HasSubstr("resumed from " + dir + "/step-00000002"));
  EXPECT_EQ(resumed.losses.begin()->first, 3) << "should resume after step 2";
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/step-00000004.corrupt"))
      << "the corrupted checkpoint is kept aside for inspection";
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-00000004"));

  // The losses after the fallback are those of a run that resumed from step 2 untouched: nothing
  // of the corrupted checkpoint's load survives the second one.
  std::string clean = MakeTempDir("ckpt-corrupt-reference");
  flags = BaseFlags(4, clean);
  flags.push_back("--set=checkpoint.interval_steps=2");
  ASSERT_EQ(RunTrainer(flags).exit_code, 0);
  std::filesystem::remove_all(clean + "/step-00000004");
  TrainerRun reference = RunTrainer(BaseFlags(6, clean));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  EXPECT_EQ(resumed.losses, reference.losses);
}

// Under dp=2 each rank hashes the shard it reads; the mismatch found by rank 1 alone sends both
// ranks back to the older checkpoint.
TEST_F(TrainerTrainingTest, ACorruptedShardOfAnotherRankSendsEveryRankToTheOlderCheckpoint) {
  std::string dir = MakeTempDir("ckpt-corrupt-dp");
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--set=checkpoint.interval_steps=2");
  for (const TrainerRun& run : RunRanks(flags, 2)) ASSERT_EQ(run.exit_code, 0) << run.output;
  FlipByte(dir + "/step-00000004/rank-00001.safetensors", 200);
  std::vector<TrainerRun> resumed = RunRanks(BaseFlags(6, dir), 2);
  ASSERT_EQ(resumed.size(), 2u);
  for (const TrainerRun& run : resumed) {
    ASSERT_EQ(run.exit_code, 0) << run.output;
    EXPECT_THAT(run.output, HasSubstr("resumed from " + dir + "/step-00000002"));
  }
  EXPECT_THAT(resumed[0].output, HasSubstr("rank-00001.safetensors: xxh3-128 mismatch"));
  EXPECT_EQ(resumed[0].losses.begin()->first, 3);
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/step-00000004.corrupt"));
}

// When the only checkpoint turns out corrupted after it was loaded, the attempt fails as a
// checkpoint error naming it (its state is no longer the initial one); the next attempt, with the
// checkpoint set aside, starts from step 1.
TEST_F(TrainerTrainingTest, AnOnlyCheckpointFoundCorruptWhileLoadingFailsTheAttemptAndIsSetAside) {
  std::string dir = MakeTempDir("ckpt-corrupt-only");
  std::vector<std::string> flags = BaseFlags(2, dir);
  flags.push_back("--set=checkpoint.interval_steps=2");
  ASSERT_EQ(RunTrainer(flags).exit_code, 0);
  FlipByte(dir + "/step-00000002/rank-00000.safetensors", 300);
  TrainerRun failed = RunTrainer(BaseFlags(4, dir));
  EXPECT_NE(failed.exit_code, 0) << failed.output;
  EXPECT_THAT(failed.output, HasSubstr("FAILURE_KIND_CHECKPOINT_ERROR"));
  EXPECT_THAT(failed.output, HasSubstr("set aside as " + dir + "/step-00000002.corrupt"));
  EXPECT_TRUE(failed.losses.empty());
  TrainerRun restarted = RunTrainer(BaseFlags(4, dir));
  ASSERT_EQ(restarted.exit_code, 0) << restarted.output;
  EXPECT_EQ(restarted.losses.begin()->first, 1);
  EXPECT_THAT(restarted.output, ::testing::Not(HasSubstr("resumed from")));
}

// Save under one layout, resume under another: the next 10 losses equal an uninterrupted run.
struct ReshardCase {
  int save_dp, save_zero, resume_dp, resume_zero;
  int save_tp = 1, save_pp = 1, resume_tp = 1, resume_pp = 1;
};

class ReshardTest : public TrainerTrainingTest,
                    public ::testing::WithParamInterface<ReshardCase> {};

TEST_P(ReshardTest, ResumedLossesEqualAnUninterruptedRun) {
  const ReshardCase& c = GetParam();
  const int n = 10;
  TrainerRun straight = RunTrainer(BaseFlags(2 * n, "", 2 * n));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const std::string dir = MakeTempDir("ckpt-reshard");
  auto flags = [&](int steps, int zero, int tp, int pp) {
    std::vector<std::string> f = BaseFlags(steps, dir, 2 * n);
    f.push_back(absl::StrCat("--set=parallelism.layout.zero_stage=", zero));
    f.push_back(absl::StrCat("--set=parallelism.layout.tensor_parallel=", tp));
    f.push_back(absl::StrCat("--set=parallelism.layout.pipeline_parallel=", pp));
    return f;
  };
  const int save_world = c.save_dp * c.save_tp * c.save_pp;
  const int resume_world = c.resume_dp * c.resume_tp * c.resume_pp;
  std::vector<TrainerRun> first = RunRanks(flags(n, c.save_zero, c.save_tp, c.save_pp), save_world);
  ASSERT_EQ(first.size(), static_cast<size_t>(save_world));
  ASSERT_EQ(first[0].exit_code, 0) << first[0].output;
  std::vector<TrainerRun> resumed =
      RunRanks(flags(2 * n, c.resume_zero, c.resume_tp, c.resume_pp), resume_world);
  ASSERT_EQ(resumed.size(), static_cast<size_t>(resume_world));
  ASSERT_EQ(resumed[0].exit_code, 0) << resumed[0].output;
  EXPECT_THAT(resumed[0].output,
              HasSubstr(absl::StrCat("written with dp ", c.save_dp, ", tp ", c.save_tp, ", pp ",
                                     c.save_pp, ", ZeRO ", c.save_zero)));
  ASSERT_EQ(resumed[0].losses.size(), static_cast<size_t>(n)) << resumed[0].output;
  for (int64_t step = n + 1; step <= 2 * n; ++step) {
    const double expected = straight.losses.at(step);
    EXPECT_LE(std::abs(resumed[0].losses.at(step) - expected) / expected, 1e-5) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ReshardTest,
    ::testing::Values(ReshardCase{4, 3, 2, 1}, ReshardCase{2, 1, 1, 0}, ReshardCase{1, 0, 4, 3},
                      ReshardCase{2, 3, 1, 3}, ReshardCase{1, 0, 1, 0, 2, 2, 1, 1},
                      ReshardCase{2, 1, 1, 0, 1, 1, 2, 1}),
    [](const ::testing::TestParamInfo<ReshardCase>& info) {
      const ReshardCase& c = info.param;
      auto layout = [](int dp, int tp, int pp, int zero) {
        return absl::StrCat("dp", dp, tp > 1 ? absl::StrCat("tp", tp) : "",
                            pp > 1 ? absl::StrCat("pp", pp) : "", "zero", zero);
      };
      return absl::StrCat(layout(c.save_dp, c.save_tp, c.save_pp, c.save_zero), "_to_",
                          layout(c.resume_dp, c.resume_tp, c.resume_pp, c.resume_zero));
    });

TEST_F(TrainerTrainingTest, CheckpointOfAnotherModelIsRefusedNamingTheTensor) {
  const std::string dir = MakeTempDir("ckpt-other-model");
  TrainerRun first = RunTrainer(BaseFlags(2, dir));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // Same directory, a model with a wider MLP: every layer's MLP weights differ in shape.
  std::vector<std::string> flags = BaseFlags(4, dir);
  flags.push_back("--set=parallelism.layout.zero_stage=2");
  std::vector<TrainerRun> runs = RunRanks(
      [&] {
        std::vector<std::string> f = flags;
        for (auto& flag : f) {
          if (flag == "--set=model.preset=tiny-gpt2") flag = "--set=model.preset=tiny-llama";
        }
        return f;
      }(),
      2);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_NE(runs[0].exit_code, 0);
  EXPECT_THAT(runs[0].output, HasSubstr("checkpoint"));
  EXPECT_THAT(runs[0].output,
              ::testing::ContainsRegex("tensor (model|exp_avg)[a-z_]*/[a-z_.0-9]+"));
  bool typed = false;
  for (const auto& report : runs[0].reports) {
    typed |= report.has_failure() && report.failure().kind() == v1::FAILURE_KIND_CHECKPOINT_ERROR;
  }
  EXPECT_TRUE(typed) << runs[0].output;
}

}  // namespace
}  // namespace tessera
