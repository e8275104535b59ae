// Tests of the pid files a worker keeps for its trainers and of the sweep that kills the trainers
// a previous worker left running.
#include "worker/orphans.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"
#include "worker/proc_stat.h"

extern char** environ;

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::Field;
using ::testing::IsEmpty;

// `sleep 60` in a process group of its own, as the worker starts a trainer.
pid_t SpawnSleeper() {
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  char arg0[] = "sleep";
  char arg1[] = "60";
  char* argv[] = {arg0, arg1, nullptr};
  pid_t pid = -1;
  const int error = posix_spawnp(&pid, "sleep", nullptr, &attributes, argv, environ);
  posix_spawnattr_destroy(&attributes);
  return error == 0 ? pid : -1;
}

// Reaps `pid` (waiting at most 10 s) and returns its wait status, or -1.
int ReapWithin10s(pid_t pid) {
  int status = -1;
  testing::WaitUntil(
      [&] {
        int wait_status = 0;
        const pid_t reaped = waitpid(pid, &wait_status, WNOHANG);
        if (reaped == pid) status = wait_status;
        return reaped != 0;  // reaped, or an error (-1 stays)
      },
      absl::Seconds(10), absl::Milliseconds(10));
  return status;
}

TEST(ProcStatTest, ParsesNamesWithSpacesAndParentheses) {
  // Fields 3..22 after the name: state, ppid, pgrp, ..., starttime = 987654.
  const std::string line =
      "4242 (tessera (rank 0)) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 3 0 987654 1 2";
  absl::StatusOr<ProcStat> stat = ParseProcStat(line);
  ASSERT_THAT(stat, IsOk());
  EXPECT_EQ(stat->state, 'S');
  EXPECT_EQ(stat->process_group, 4242);
  EXPECT_EQ(stat->start_time, 987654u);
  EXPECT_THAT(ParseProcStat("4242 (short) S 1 2"),
              StatusIs(absl::StatusCode::kInternal, ::testing::_));
}

TEST(ProcStatTest, ReadsAStoppedProcessState) {
  const pid_t pid = SpawnSleeper();
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  absl::StatusOr<ProcStat> stat;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    stat = ReadProcStat(pid);
  } while (stat.ok() && stat->state != 'T' && absl::Now() < deadline);
  ASSERT_THAT(stat, IsOk());
  EXPECT_EQ(stat->state, 'T');
  EXPECT_EQ(stat->process_group, pid);
  EXPECT_EQ(DescribeProcessState(stat->state), "stopped");
  kill(pid, SIGKILL);
  ReapWithin10s(pid);
  EXPECT_THAT(ReadProcStat(pid), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
}

TEST(OrphansTest, PidFileRoundTripsAndIsRemoved) {
  const std::string dir = absl::StrCat(::tessera::testing::TestDir(), "/trainers");
  ASSERT_THAT(RecordTrainer(dir, getpid(), "job-1/0/n1", 3), IsOk());
  absl::StatusOr<TrainerRecord> record = ReadPidFile(PidFilePath(dir, getpid()));
  ASSERT_THAT(record, IsOk());
  EXPECT_EQ(record->pid, getpid());
  EXPECT_EQ(record->task_id, "job-1/0/n1");
  EXPECT_EQ(record->rank, 3);
  EXPECT_EQ(record->start_time, ReadProcStat(getpid())->start_time);
  ASSERT_THAT(RemovePidFile(dir, getpid()), IsOk());
  EXPECT_FALSE(std::filesystem::exists(PidFilePath(dir, getpid())));
  EXPECT_THAT(RemovePidFile(dir, getpid()), IsOk()) << "removing an absent file is not an error";
}

TEST(OrphansTest, KillsALiveTrainerLeftByAPreviousWorker) {
  const std::string dir = absl::StrCat(::tessera::testing::TestDir(), "/trainers");
  const pid_t orphan = SpawnSleeper();
  ASSERT_GT(orphan, 0);
  ASSERT_THAT(RecordTrainer(dir, orphan, "job-1/0/n1", 1), IsOk());

  absl::StatusOr<OrphanSweep> sweep = KillOrphanedTrainers(dir);
  ASSERT_THAT(sweep, IsOk());
  EXPECT_THAT(sweep->killed, ElementsAre(Field(&TrainerRecord::pid, orphan)));
  EXPECT_THAT(sweep->survived, IsEmpty());
  EXPECT_FALSE(std::filesystem::exists(PidFilePath(dir, orphan)));
  // It is this test's child, so it waits as a zombie for us: it died of SIGKILL.
  const int status = ReapWithin10s(orphan);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

TEST(OrphansTest, SparesAProcessWhosePidWasReused) {
  const std::string dir = absl::StrCat(::tessera::testing::TestDir(), "/trainers");
  const pid_t bystander = SpawnSleeper();
  ASSERT_GT(bystander, 0);
  absl::StatusOr<ProcStat> stat = ReadProcStat(bystander);
  ASSERT_THAT(stat, IsOk());
  // The record names the pid but another start time: an earlier process that had the pid.
  ASSERT_THAT(WritePidFile(dir, {.pid = bystander,
                                 .task_id = "job-1/0/n1",
                                 .rank = 0,
                                 .start_time = stat->start_time - 1}),
              IsOk());
  absl::StatusOr<OrphanSweep> sweep = KillOrphanedTrainers(dir);
  ASSERT_THAT(sweep, IsOk());
  EXPECT_THAT(sweep->killed, IsEmpty());
  EXPECT_THAT(sweep->stale, ElementsAre(Field(&TrainerRecord::pid, bystander)));
  EXPECT_FALSE(std::filesystem::exists(PidFilePath(dir, bystander)));
  EXPECT_EQ(kill(bystander, 0), 0) << "the bystander was killed";
  int status = 0;
  EXPECT_EQ(waitpid(bystander, &status, WNOHANG), 0) << "the bystander exited";
  kill(bystander, SIGKILL);
  ReapWithin10s(bystander);
}

TEST(OrphansTest, MissingDirectoryAndMalformedFiles) {
  const std::string dir = absl::StrCat(::tessera::testing::TestDir(), "/trainers");
  absl::StatusOr<OrphanSweep> empty = KillOrphanedTrainers(dir);
  ASSERT_THAT(empty, IsOk());
  EXPECT_THAT(empty->killed, IsEmpty());
  std::filesystem::create_directories(dir);
  std::ofstream(absl::StrCat(dir, "/123.pid")) << "garbage\n";
  absl::StatusOr<OrphanSweep> sweep = KillOrphanedTrainers(dir);
  ASSERT_THAT(sweep, IsOk());
  EXPECT_EQ(sweep->unreadable.size(), 1u);
  EXPECT_THAT(sweep->killed, IsEmpty());
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/123.pid")));
}

}  // namespace
}  // namespace tessera::worker
