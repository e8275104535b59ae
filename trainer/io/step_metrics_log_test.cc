// The step metrics a checkpoint carries (step_metrics_log.h): the log's cap and carry-over, the
// file through a real commit and verification, and what a resumed attempt reports again.
#include "trainer/io/step_metrics_log.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "common/xxh3.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "trainer/io/checkpoint.h"

namespace tessera::trainer {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::tessera::testing::IsOk;
using ::tessera::testing::ReadBytes;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::testing::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

v1::StepMetrics Point(int64_t step, double loss) {
  v1::StepMetrics point;
  point.set_step(step);
  point.set_loss(loss);
  point.set_learning_rate(1e-3 * step);
  return point;
}

std::vector<int64_t> Steps(const v1::StepMetricsLog& log) {
  std::vector<int64_t> steps;
  for (const v1::StepMetrics& point : log.points()) steps.push_back(point.step());
  return steps;
}

std::vector<int64_t> Steps(const std::vector<v1::StepMetrics>& points) {
  std::vector<int64_t> steps;
  for (const v1::StepMetrics& point : points) steps.push_back(point.step());
  return steps;
}

std::vector<int64_t> Range(int64_t first, int64_t last) {
  std::vector<int64_t> steps;
  for (int64_t step = first; step <= last; ++step) steps.push_back(step);
  return steps;
}

// Rank 0's part of a save as trainer/engine/checkpointing.cc plays it: a shard and, when `log`
// is given, the step metrics file in the staging directory, then the commit.
absl::StatusOr<v1::CheckpointManifest> Save(const std::string& root, int64_t step,
                                            const v1::StepMetricsLog* log) {
  absl::StatusOr<std::string> staging = PrepareStaging(root, step);
  if (!staging.ok()) return staging.status();
  WriteBytes(*staging + "/" + ShardFileName(0), std::string(512, static_cast<char>(step)));
  std::map<std::string, std::string> known;
  if (log != nullptr) {
    absl::StatusOr<v1::CheckpointFile> file = WriteEncodedStepMetricsFile(*staging, log->SerializeAsString());
    if (!file.ok()) return file.status();
    known[file->file()] = file->xxh3_128();
  }
  v1::CheckpointManifest manifest;
  manifest.set_job_id("job-1");
  return CommitCheckpoint(root, step, manifest, /*world_size=*/1, /*keep_last=*/0, known);
}

std::string Dir(const std::string& root, int64_t step) {
  return root + "/" + CheckpointDirName(step);
}

TEST(StepMetricsLogTest, KeepsOnePointPerStepAndOnlyTheLastCapacitySteps) {
  StepMetricsLog log(/*capacity=*/5);
  for (int64_t step = 1; step <= 12; ++step) log.Add(Point(step, 10.0 - 0.1 * step));
  EXPECT_EQ(log.size(), 5u);
  EXPECT_THAT(Steps(log.UpTo(12)), ElementsAre(8, 9, 10, 11, 12));
  // A checkpoint of an earlier step (the save of step 10 taken before 11 and 12 were added).
  EXPECT_THAT(Steps(log.UpTo(10)), ElementsAre(8, 9, 10));
  // A step reported again (after a rollback) replaces its point.
  log.Add(Point(10, 42.0));
  const v1::StepMetricsLog kept = log.UpTo(12);
  ASSERT_EQ(kept.points_size(), 5);
  EXPECT_DOUBLE_EQ(kept.points(2).loss(), 42.0);
}

// The snapshot a save takes is the log's points serialized once each, as they were added: the
// same bytes as a v1::StepMetricsLog built from those points and serialized whole, also after a
// step is replaced and the oldest dropped.
TEST(StepMetricsLogTest, EncodedUpToIsTheSerializedLogOfThoseSteps) {
  StepMetricsLog log(/*capacity=*/6);
  for (int64_t step = 1; step <= 9; ++step) {
    v1::StepMetrics point = Point(step, 1.0 / step);
    point.mutable_breakdown()->add_collectives()->set_kind("all_reduce");
    point.mutable_time()->set_seconds(1790000000 + step);
    log.Add(point);
  }
  log.Add(Point(7, 42.0));
  v1::StepMetricsLog expected;
  for (int64_t step = 4; step <= 8; ++step) {
    v1::StepMetrics point = Point(step, 1.0 / step);
    point.mutable_breakdown()->add_collectives()->set_kind("all_reduce");
    point.mutable_time()->set_seconds(1790000000 + step);
    *expected.add_points() = step == 7 ? Point(7, 42.0) : point;
  }
  std::string expected_bytes;
  ASSERT_TRUE(expected.SerializeToString(&expected_bytes));
  EXPECT_EQ(log.EncodedUpTo(8), expected_bytes);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(log.UpTo(8), expected));
  EXPECT_EQ(log.EncodedUpTo(3), "");
}

TEST(StepMetricsLogTest, TheDefaultCapacityHoldsTenThousandPoints) {
  StepMetricsLog log;
  for (int64_t step = 1; step <= 10050; ++step) log.Add(Point(step, 1.0));
  const v1::StepMetricsLog kept = log.UpTo(10050);
  ASSERT_EQ(kept.points_size(), 10000);
  EXPECT_EQ(kept.points(0).step(), 51);
  EXPECT_EQ(kept.points(9999).step(), 10050);
  // A few MB at most.
  EXPECT_LT(kept.ByteSizeLong(), 4u << 20);
}

TEST(StepMetricsLogTest, FileRoundTripsThroughACommitAndIsListedInTheManifest) {
  ScopedTempDir tmp("step_metrics_log_test");
  StepMetricsLog log;
  for (int64_t step = 1; step <= 30; ++step) log.Add(Point(step, 5.0 / step));
  const v1::StepMetricsLog carried = log.UpTo(20);
  absl::StatusOr<v1::CheckpointManifest> manifest = Save(tmp.path(), 20, &carried);
  ASSERT_THAT(manifest, IsOk());
  ASSERT_TRUE(manifest->has_step_metrics());
  EXPECT_EQ(manifest->step_metrics().file(), kStepMetricsFileName);
  const std::string path = Dir(tmp.path(), 20) + "/" + kStepMetricsFileName;
  EXPECT_EQ(manifest->step_metrics().size_bytes(), std::filesystem::file_size(path));
  // Not listed as a shard.
  ASSERT_EQ(manifest->shards_size(), 1);
  EXPECT_EQ(manifest->shards(0).file(), ShardFileName(0));

  absl::StatusOr<v1::CheckpointManifest> verified = VerifyCheckpoint(Dir(tmp.path(), 20));
  ASSERT_THAT(verified, IsOk());
  absl::StatusOr<std::optional<v1::StepMetricsLog>> read =
      ReadStepMetricsFile(Dir(tmp.path(), 20), *verified);
  ASSERT_THAT(read, IsOk());
  ASSERT_TRUE(read->has_value());
  EXPECT_TRUE(MessageDifferencer::Equals(**read, carried));
  EXPECT_THAT(Steps(**read), Range(1, 20));
}

TEST(StepMetricsLogTest, AResumedAttemptCarriesTheCheckpointsPointsIntoItsOwnSaves) {
  ScopedTempDir tmp("step_metrics_log_test");
  // Attempt 0 trains steps 1..18 and checkpoints step 15; its later steps are lost with it.
  StepMetricsLog first;
  for (int64_t step = 1; step <= 18; ++step) first.Add(Point(step, 1.0));
  const v1::StepMetricsLog at_15 = first.UpTo(15);
  ASSERT_THAT(Save(tmp.path(), 15, &at_15), IsOk());

  // Attempt 1 resumes from step 15, trains 16..30 (other losses) and checkpoints step 25.
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(tmp.path(), nullptr);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  absl::StatusOr<std::optional<v1::StepMetricsLog>> resumed =
      ReadStepMetricsFile((*found)->path, (*found)->manifest);
  ASSERT_THAT(resumed, IsOk());
  ASSERT_TRUE(resumed->has_value());
  StepMetricsLog second;
  v1::StepMetricsLog with_a_stray_point = **resumed;
  *with_a_stray_point.add_points() = Point(17, 99.0);  // beyond the resumed step: not carried
  second.AddAll(with_a_stray_point, (*found)->manifest.step());
  for (int64_t step = 16; step <= 30; ++step) second.Add(Point(step, 2.0));
  const v1::StepMetricsLog at_25 = second.UpTo(25);
  ASSERT_THAT(Save(tmp.path(), 25, &at_25), IsOk());

  absl::StatusOr<v1::CheckpointManifest> manifest = VerifyCheckpoint(Dir(tmp.path(), 25));
  ASSERT_THAT(manifest, IsOk());
  absl::StatusOr<std::optional<v1::StepMetricsLog>> read =
      ReadStepMetricsFile(Dir(tmp.path(), 25), *manifest);
  ASSERT_THAT(read, IsOk());
  ASSERT_TRUE(read->has_value());
  ASSERT_THAT(Steps(**read), Range(1, 25));
  for (const v1::StepMetrics& point : (*read)->points()) {
    EXPECT_DOUBLE_EQ(point.loss(), point.step() <= 15 ? 1.0 : 2.0) << "step " << point.step();
  }
}

TEST(StepMetricsLogTest, ACorruptedOrMissingFileIsNamedByVerification) {
  ScopedTempDir tmp("step_metrics_log_test");
  StepMetricsLog log;
  for (int64_t step = 1; step <= 10; ++step) log.Add(Point(step, 1.0));
  const v1::StepMetricsLog carried = log.UpTo(10);
  ASSERT_THAT(Save(tmp.path(), 10, &carried), IsOk());
  const std::string dir = Dir(tmp.path(), 10);
  const std::string path = dir + "/" + kStepMetricsFileName;
  const std::string good = ReadBytes(path);

  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x04;
  WriteBytes(path, flipped);
  EXPECT_THAT(VerifyCheckpoint(dir),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path + ": xxh3-128 mismatch (manifest "),
                             HasSubstr(", file " + Xxh3Hex(flipped) + ")"))));
  // The structure-only check a resume starts with passes; reading the file checks its digest.
  absl::StatusOr<v1::CheckpointManifest> structure = VerifyCheckpoint(dir, DigestCheck::kNone);
  ASSERT_THAT(structure, IsOk());
  EXPECT_THAT(ReadStepMetricsFile(dir, *structure),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path + ": xxh3-128 mismatch")));

  WriteBytes(path, good.substr(0, good.size() - 3));
  EXPECT_THAT(VerifyCheckpoint(dir, DigestCheck::kNone),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat(path, ": size ", good.size() - 3,
                                              " bytes, manifest says ", good.size()))));
  std::filesystem::remove(path);
  EXPECT_THAT(VerifyCheckpoint(dir),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(path + ": missing (listed in the manifest)")));
  // A resume skips it as it skips a checkpoint with a bad shard.
  std::vector<std::string> skipped;
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(tmp.path(), &skipped);
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_THAT(skipped[0], HasSubstr(kStepMetricsFileName));
}

TEST(StepMetricsLogTest, ACheckpointWithoutTheFileStillLoadsAndCarriesNothing) {
  ScopedTempDir tmp("step_metrics_log_test");
  absl::StatusOr<v1::CheckpointManifest> manifest = Save(tmp.path(), 10, nullptr);
  ASSERT_THAT(manifest, IsOk());
  EXPECT_FALSE(manifest->has_step_metrics());
  absl::StatusOr<v1::CheckpointManifest> verified = VerifyCheckpoint(Dir(tmp.path(), 10));
  ASSERT_THAT(verified, IsOk());
  absl::StatusOr<std::optional<v1::StepMetricsLog>> read =
      ReadStepMetricsFile(Dir(tmp.path(), 10), *verified);
  ASSERT_THAT(read, IsOk());
  EXPECT_FALSE(read->has_value());
  const Backfill backfill = PlanBackfill(nullptr, 3, 10);
  EXPECT_THAT(backfill.points, IsEmpty());
  EXPECT_THAT(backfill.uncovered, ElementsAre(Pair(4, 10)));
}

TEST(StepMetricsLogTest, BackfillReportsTheStepsAboveTheRecordsWatermarkUpToTheResumedStep) {
  StepMetricsLog log;
  for (int64_t step = 1; step <= 40; ++step) log.Add(Point(step, 1.0));
  const v1::StepMetricsLog carried = log.UpTo(30);

  Backfill backfill = PlanBackfill(&carried, 22, 30);
  EXPECT_THAT(Steps(backfill.points), Range(23, 30));
  EXPECT_THAT(backfill.uncovered, IsEmpty());
  // A complete record: nothing again.
  EXPECT_THAT(PlanBackfill(&carried, 30, 30).points, IsEmpty());
  EXPECT_THAT(PlanBackfill(&carried, 35, 30).points, IsEmpty());
  EXPECT_THAT(PlanBackfill(&carried, 35, 30).uncovered, IsEmpty());
  // Nothing recorded at all.
  EXPECT_THAT(Steps(PlanBackfill(&carried, 0, 30).points), Range(1, 30));
}

TEST(StepMetricsLogTest, BackfillNamesTheStepsTheCheckpointCannotCover) {
  // The cap left steps 1..10 out; step 17 was never reported (a NaN step is not applied).
  StepMetricsLog log(/*capacity=*/20);
  for (int64_t step = 1; step <= 30; ++step) {
    if (step != 17) log.Add(Point(step, 1.0));
  }
  const v1::StepMetricsLog carried = log.UpTo(30);
  ASSERT_EQ(carried.points(0).step(), 10);
  const Backfill backfill = PlanBackfill(&carried, 4, 25);
  std::vector<int64_t> expected = Range(10, 16);
  for (int64_t step = 18; step <= 25; ++step) expected.push_back(step);
  EXPECT_THAT(Steps(backfill.points), expected);
  EXPECT_THAT(backfill.uncovered, ElementsAre(Pair(5, 9), Pair(17, 17)));
}

}  // namespace
}  // namespace tessera::trainer
