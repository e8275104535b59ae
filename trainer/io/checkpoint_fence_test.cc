#include "trainer/io/checkpoint_fence.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"
#include "trainer/io/checkpoint.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::ReadBytes;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::StatusIs;
using ::tessera::testing::WriteBytes;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kJob[] = "job-1";

bool Exists(const std::string& path) {
  struct stat info;
  return ::stat(path.c_str(), &info) == 0;
}

// Distinct shard bytes for each (step, writer), so that a test tells whose checkpoint it reads.
std::string ShardContent(int64_t step, const std::string& writer) {
  return absl::StrCat("step ", step, " written by ", writer, std::string(200, 'x'));
}

// Stages one rank's shard of `step` and commits it as `attempt` of `job`.
absl::StatusOr<v1::CheckpointManifest> CommitAs(const std::string& root, int64_t step,
                                                const std::string& job, int64_t attempt,
                                                const std::string& content) {
  absl::StatusOr<std::string> staging = PrepareStaging(root, step);
  if (!staging.ok()) return staging.status();
  WriteBytes(*staging + "/" + ShardFileName(0), content);
  v1::CheckpointManifest manifest;
  manifest.set_job_id(job);
  return CommitCheckpoint(root, step, manifest, /*world_size=*/1, /*keep_last=*/0, {}, attempt);
}

std::string ShardOf(const std::string& root, int64_t step) {
  return ReadBytes(root + "/" + CheckpointDirName(step) + "/" + ShardFileName(0));
}

TEST(CheckpointFenceTest, AbsentFenceCountsAsAttemptZeroOfAnyJob) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path() + "/ckpt";
  absl::StatusOr<CheckpointFence> fence = ReadCheckpointFence(root);
  ASSERT_THAT(fence, IsOk());
  EXPECT_FALSE(fence->present);
  // A directory written before fences existed: every attempt commits, and the checkpoint loads.
  ASSERT_THAT(CommitAs(root, 5, kJob, 0, ShardContent(5, "a0")), IsOk());
  ASSERT_THAT(CommitAs(root, 10, "other-job", 7, ShardContent(10, "other")), IsOk());
  EXPECT_FALSE(Exists(root + "/" + kFenceFileName));
  // Raising a fence later keeps the older checkpoints loadable: FENCE is no checkpoint.
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 1), IsOk());
  absl::StatusOr<std::optional<FoundCheckpoint>> found = FindLatestCheckpoint(root, nullptr);
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->manifest.step(), 10);
  EXPECT_EQ(ListCheckpointDirs(root).size(), 2u);
}

TEST(CheckpointFenceTest, RaiseRecordsTheHighestAttemptAndRefusesALowerOne) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path() + "/new/ckpt";  // created by the raise
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 3), IsOk());
  absl::StatusOr<CheckpointFence> fence = ReadCheckpointFence(root);
  ASSERT_THAT(fence, IsOk());
  EXPECT_TRUE(fence->present);
  EXPECT_EQ(fence->job_id, kJob);
  EXPECT_EQ(fence->attempt, 3);
  EXPECT_THAT(RaiseCheckpointFence(root, kJob, 2),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("attempt 2 of job job-1"),
                             HasSubstr("fenced off by attempt 3 of job job-1"),
                             HasSubstr(root + "/FENCE"))));
  EXPECT_THAT(RaiseCheckpointFence(root, kJob, 3), IsOk());
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 4), IsOk());
  EXPECT_EQ(ReadCheckpointFence(root)->attempt, 4);
  EXPECT_FALSE(Exists(root + "/FENCE.tmp"));
  EXPECT_THAT(RaiseCheckpointFence(root, kJob, -1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative")));
}

TEST(CheckpointFenceTest, StaleCommitIsRefusedAndNewerCheckpointStaysIntact) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 2), IsOk());
  ASSERT_THAT(CommitAs(root, 10, kJob, 2, ShardContent(10, "attempt 2")), IsOk());
  // Attempt 3 starts and commits step 10 again (it resumed from an older step).
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 3), IsOk());
  ASSERT_THAT(CommitAs(root, 10, kJob, 3, ShardContent(10, "attempt 3")), IsOk());
  // The stale attempt 2 wakes up: neither a replacement of step 10 nor a new step 20 lands.
  EXPECT_THAT(CommitAs(root, 10, kJob, 2, ShardContent(10, "stale attempt 2")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("checkpoint write refused: attempt 2 of job job-1 is "
                                       "fenced off by attempt 3 of job job-1 in " +
                                       root + "/FENCE"),
                             HasSubstr("stale"))));
  EXPECT_THAT(CommitAs(root, 20, kJob, 2, ShardContent(20, "stale attempt 2")),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_EQ(ShardOf(root, 10), ShardContent(10, "attempt 3"));
  EXPECT_THAT(ListCheckpointDirs(root), ElementsAre(root + "/" + CheckpointDirName(10)));
  ASSERT_THAT(VerifyCheckpoint(root + "/" + CheckpointDirName(10)), IsOk());
  EXPECT_THAT(CheckCheckpointFence(root, kJob, 2),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(CheckCheckpointFence(root, kJob, 3), IsOk());
  EXPECT_THAT(CheckCheckpointFence(root, kJob, 4), IsOk());
  // The default attempt (0) is fenced off by any restart.
  v1::CheckpointManifest manifest;
  manifest.set_job_id(kJob);
  ASSERT_THAT(PrepareStaging(root, 30), IsOk());
  WriteBytes(StagingDir(root, 30) + "/" + ShardFileName(0), "x");
  EXPECT_THAT(CommitCheckpoint(root, 30, manifest, 1, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("attempt 0 of job job-1")));
}

TEST(CheckpointFenceTest, AnotherJobTakesTheDirectoryOver) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  ASSERT_THAT(RaiseCheckpointFence(root, "job-a", 5), IsOk());
  ASSERT_THAT(CommitAs(root, 1, "job-a", 5, ShardContent(1, "a")), IsOk());
  // A new job resuming from job-a's directory starts at attempt 0: not refused for its number.
  ASSERT_THAT(RaiseCheckpointFence(root, "job-b", 0), IsOk());
  EXPECT_EQ(ReadCheckpointFence(root)->job_id, "job-b");
  EXPECT_THAT(CommitAs(root, 2, "job-a", 5, ShardContent(2, "a")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("another job has taken the checkpoint directory over")));
  EXPECT_THAT(CommitAs(root, 2, "job-b", 0, ShardContent(2, "b")), IsOk());
}

TEST(CheckpointFenceTest, UnparseableFenceIsDataLossNamingIt) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  WriteBytes(root + "/FENCE", "attempt three\n");
  EXPECT_THAT(ReadCheckpointFence(root),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(root + "/FENCE")));
  EXPECT_THAT(CommitAs(root, 1, kJob, 9, "x"), StatusIs(absl::StatusCode::kDataLoss, ::testing::_));
}

TEST(CheckpointFenceTest, LockWaitIsBounded) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  absl::StatusOr<FenceLock> held = FenceLock::Acquire(root);
  ASSERT_THAT(held, IsOk());
  EXPECT_THAT(RaiseCheckpointFence(root, kJob, 1, std::chrono::milliseconds(50)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr(root + ": still locked")));
  *held = FenceLock::Acquire(tmp.path() + "/elsewhere").value();  // releases the first lock
  EXPECT_THAT(RaiseCheckpointFence(root, kJob, 1, std::chrono::milliseconds(50)), IsOk());
}

// A raise in progress (the lock held, as a new attempt's rank 0 holds it) holds back a commit of
// the old attempt that already passed every other step; once the fence is up it is refused. Were
// the check and the rename not under the lock, the commit would land while the raise is held.
TEST(CheckpointFenceTest, CommitWaitsForARaiseInProgressThenIsRefused) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 1), IsOk());
  ASSERT_THAT(PrepareStaging(root, 7), IsOk());
  WriteBytes(StagingDir(root, 7) + "/" + ShardFileName(0), ShardContent(7, "attempt 1"));
  absl::StatusOr<FenceLock> raise_lock = FenceLock::Acquire(root);
  ASSERT_THAT(raise_lock, IsOk());
  std::atomic<bool> done{false};
  absl::Status commit_status;
  std::thread old_rank0([&] {
    v1::CheckpointManifest manifest;
    manifest.set_job_id(kJob);
    commit_status = CommitCheckpoint(root, 7, manifest, 1, 0, {}, 1).status();
    done = true;
  });
  // The commit waits for the raise's lock: it does not end within 300 ms (nor early).
  EXPECT_FALSE(::tessera::testing::WaitUntil([&] { return done.load(); }, absl::Milliseconds(300)));
  EXPECT_FALSE(Exists(root + "/" + CheckpointDirName(7)));
  ASSERT_THAT(RaiseCheckpointFenceLocked(root, kJob, 2), IsOk());
  { FenceLock released = *std::move(raise_lock); }
  old_rank0.join();
  EXPECT_THAT(commit_status, StatusIs(absl::StatusCode::kFailedPrecondition,
                                      HasSubstr("fenced off by attempt 2")));
  EXPECT_THAT(ListCheckpointDirs(root), IsEmpty());
}

// Two processes: the old attempt's rank 0 commits step after step as fast as it can while the new
// attempt's rank 0 raises the fence. Every checkpoint present right after the raise returned is
// all there ever is: no commit of the old attempt lands after the raise.
TEST(CheckpointFenceTest, RacingProcessesNeverCommitAfterTheRaise) {
  ScopedTempDir tmp("fence_test");
  const std::string root = tmp.path();
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 1), IsOk());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    for (int64_t step = 1; step < 100000; ++step) {
      absl::StatusOr<v1::CheckpointManifest> committed =
          CommitAs(root, step, kJob, 1, ShardContent(step, "attempt 1"));
      if (!committed.ok()) {
        ::_exit(absl::IsFailedPrecondition(committed.status()) ? 10 : 11);
      }
    }
    ::_exit(12);
  }
  // Let the old attempt commit a few checkpoints first.
  testing::WaitUntil([&] { return Exists(root + "/" + CheckpointDirName(3)); }, absl::Seconds(30),
                     absl::Milliseconds(1));
  ASSERT_THAT(RaiseCheckpointFence(root, kJob, 2), IsOk());
  const std::vector<std::string> after_raise = ListCheckpointDirs(root);
  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 10) << "11: another error, 12: never refused";
  EXPECT_GE(after_raise.size(), 3u);
  EXPECT_EQ(ListCheckpointDirs(root), after_raise);
  for (const std::string& dir : after_raise) EXPECT_THAT(VerifyCheckpoint(dir), IsOk()) << dir;
}

}  // namespace
}  // namespace tessera::trainer
