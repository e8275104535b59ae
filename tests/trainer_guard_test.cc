// Real tessera-trainer processes under the loss-spike guard (JobSpec.guard), the coordinator's
// part played by the test: a spike injected at a global batch (kFaultLossSpikeAtBatchEnv) is not
// applied and not checkpointed, the trainer reports it and fails with FAILURE_KIND_LOSS_SPIKE;
// the rerun the coordinator would start (the same checkpoints, the batch in guard.skipped)
// resumes from the checkpoint before the spike, replays up to it, skips the batch and trains on
// exactly as a run that skipped that batch from the start. Under dp=2 the ranks decide together.
// The coordinator's rollback decision is tested in process (coordinator/loss_guard_rollback_test).

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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

constexpr int kSteps = 12;
// Batch 8 is poisoned; checkpoints every 3 steps, so the last good one before it is step 6.
constexpr int kPoisonedBatch = 8;

std::optional<v1::LossSpike> SpikeOf(const TrainerRun& run) {
  for (const auto& report : run.reports) {
    if (report.has_loss_spike()) return report.loss_spike();
  }
  return std::nullopt;
}

std::optional<v1::TrainerFailure> FailureOf(const TrainerRun& run) {
  for (const auto& report : run.reports) {
    if (report.has_failure()) return report.failure();
  }
  return std::nullopt;
}

std::vector<std::string> Guarded(std::vector<std::string> flags, const std::string& guard,
                                 bool poisoned) {
  flags.push_back("--set=guard=" + guard);
  if (!poisoned) return flags;
  std::vector<std::string> argv = {"/usr/bin/env",
                                   absl::StrCat(kFaultLossSpikeAtBatchEnv, "=", kPoisonedBatch)};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

TEST_F(TrainerTrainingTest, ASpikeRollsBackSkipsItsBatchAndTrainsOnAsIfSkippedFromTheStart) {
  const std::string guard = "{loss_spike_factor: 5, window: 3}";
  const std::string skip = absl::StrCat(
      "{loss_spike_factor: 5, window: 3, skipped: [{step: ", kPoisonedBatch, ", batches: 1}]}");
  const std::string dir = MakeTempDir("guard-rollback");
  std::vector<std::string> flags = BaseFlags(kSteps, dir, kSteps);
  flags.push_back("--set=checkpoint.interval_steps=3");

  // The spike: steps 1-7 train, step 8's update is withheld, no checkpoint of it is started.
  TrainerRun spiked = RunTrainer(Guarded(flags, guard, /*poisoned=*/true));
  EXPECT_NE(spiked.exit_code, 0) << spiked.output;
  const std::optional<v1::LossSpike> spike = SpikeOf(spiked);
  ASSERT_TRUE(spike.has_value()) << spiked.output;
  EXPECT_EQ(spike->step(), kPoisonedBatch);
  EXPECT_EQ(spike->batch_index(), kPoisonedBatch - 1);
  EXPECT_GT(spike->loss_median(), 0);
  EXPECT_GT(spike->loss(), 5 * spike->loss_median());
  EXPECT_THAT(spike->cause(), HasSubstr("> 5 x median"));
  const std::optional<v1::TrainerFailure> failure = FailureOf(spiked);
  ASSERT_TRUE(failure.has_value()) << spiked.output;
  EXPECT_EQ(failure->kind(), v1::FAILURE_KIND_LOSS_SPIKE);
  EXPECT_EQ(failure->step(), kPoisonedBatch - 1) << "the last step it finished";
  EXPECT_EQ(spiked.losses.rbegin()->first, kPoisonedBatch - 1) << "the spike is never reported";
  EXPECT_TRUE(fs::exists(dir + "/step-00000006/manifest.pb"));
  EXPECT_FALSE(fs::exists(dir + "/step-00000008"));
  EXPECT_FALSE(fs::exists(dir + "/step-00000009"));

  // The rollback: the same checkpoints, the poisoned batch skipped (the fault stays armed).
  TrainerRun rolled = RunTrainer(Guarded(flags, skip, /*poisoned=*/true));
  ASSERT_EQ(rolled.exit_code, 0) << rolled.output;
  EXPECT_THAT(rolled.output, HasSubstr("resumed from " + dir + "/step-00000006"));
  EXPECT_THAT(rolled.output, HasSubstr("step 8: 1 global batch(es) skipped"));
  EXPECT_FALSE(SpikeOf(rolled).has_value()) << rolled.output;
  ASSERT_EQ(rolled.losses.begin()->first, 7);
  // Step 7 is replayed from the checkpoint exactly as the first attempt trained it.
  EXPECT_NEAR(rolled.losses.at(7), spiked.losses.at(7), 1e-5);

  // The reference skipped the batch from the start, without checkpoints or faults.
  TrainerRun reference = RunTrainer(Guarded(BaseFlags(kSteps, "", kSteps), skip, false));
  ASSERT_EQ(reference.exit_code, 0) << reference.output;
  for (int64_t step = 1; step < kPoisonedBatch; ++step) {
    EXPECT_NEAR(spiked.losses.at(step), reference.losses.at(step), 1e-5) << "step " << step;
  }
  for (int64_t step = 7; step <= kSteps; ++step) {
    EXPECT_NEAR(rolled.losses.at(step), reference.losses.at(step), 1e-5) << "step " << step;
  }
  // Skipping changed the data: step 8 trains on what step 9 would have without the skip.
  TrainerRun unskipped = RunTrainer(BaseFlags(kSteps, "", kSteps));
  ASSERT_EQ(unskipped.exit_code, 0) << unskipped.output;
  EXPECT_GT(std::abs(unskipped.losses.at(8) - reference.losses.at(8)), 1e-4);
}

// A NaN loss under a guard is a spike too (no factor needed), and under dp=2 every rank withholds
// the step and ends with FAILURE_KIND_LOSS_SPIKE; only rank 0 reports the spike.
TEST_F(TrainerTrainingTest, NanUnderAGuardIsASpikeEveryRankAgreesOn) {
  std::vector<std::string> flags = BaseFlags(6, "", 6);
  flags.push_back("--set=guard={window: 2}");
  std::vector<std::string> argv = {"/usr/bin/env", absl::StrCat(kFaultNanLossAtStepEnv, "=3")};
  argv.insert(argv.end(), flags.begin(), flags.end());
  std::vector<TrainerRun> ranks = RunRanks(argv, 2);
  ASSERT_EQ(ranks.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const TrainerRun& run = ranks[rank];
    EXPECT_NE(run.exit_code, 0) << run.output;
    const std::optional<v1::TrainerFailure> failure = FailureOf(run);
    ASSERT_TRUE(failure.has_value()) << run.output;
    EXPECT_EQ(failure->kind(), v1::FAILURE_KIND_LOSS_SPIKE) << "rank " << rank;
    EXPECT_THAT(failure->message(), HasSubstr("loss is nan at step 3"));
    EXPECT_EQ(SpikeOf(run).has_value(), rank == 0) << run.output;
  }
}

}  // namespace
}  // namespace tessera
