// Tests of TrainerProcess against tests/fake_trainer: launch, environment, exit codes, signals,
// stopping with escalation, and that no process of a trainer's group outlives it.
#include "worker/trainer_process.h"

#include <dirent.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/trainer.pb.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr char kFakeTrainer[] = TESSERA_FAKE_TRAINER;
constexpr absl::Duration kTestTimeout = absl::Seconds(30);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Waits until the log at `path` contains `needle`.
bool WaitForLog(const std::string& path, const std::string& needle) {
  return testing::WaitUntil([&] { return ReadFile(path).find(needle) != std::string::npos; },
                            kTestTimeout, absl::Milliseconds(10));
}

std::optional<ExitStatus> WaitForExit(TrainerProcess& process) {
  std::optional<ExitStatus> exit;
  testing::WaitUntil([&] { return (exit = process.Poll()).has_value(); }, kTestTimeout,
                     absl::Milliseconds(10));
  return exit;
}

// Every process (zombies included) whose process group is `pgid`, from /proc.
std::vector<pid_t> GroupMembers(pid_t pgid) {
  std::vector<pid_t> members;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
    // "pid (comm) state ppid pgrp ...": comm may hold spaces, so parse after the last ')'.
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 1));
    std::string state;
    pid_t ppid = 0;
    pid_t pgrp = 0;
    if (fields >> state >> ppid >> pgrp && pgrp == pgid) members.push_back(pid);
  }
  return members;
}

// The pid the fake printed as CHILD_PID, or -1.
pid_t ChildPidFromLog(const std::string& log) {
  const std::string key = "CHILD_PID=";
  const size_t at = log.find(key);
  if (at == std::string::npos) return -1;
  pid_t pid = -1;
  const size_t end = log.find('\n', at);
  if (!absl::SimpleAtoi(log.substr(at + key.size(), end - at - key.size()), &pid)) return -1;
  return pid;
}

// Asserts that nothing of group `pgid` is left: neither kill() nor /proc finds a member.
void ExpectGroupGone(pid_t pgid) {
  errno = 0;
  EXPECT_EQ(kill(-pgid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
  EXPECT_THAT(GroupMembers(pgid), IsEmpty());
}

class TrainerProcessTest : public ::testing::Test {
 protected:
  // Grandchildren orphaned by the fake are re-parented to this test and reaped by
  // TrainerProcess, as in the worker daemon; else this container's init may never reap them.
  static void SetUpTestSuite() { ASSERT_THAT(BecomeChildSubreaper(), IsOk()); }

  LaunchSpec Spec(std::vector<std::string> args) {
    LaunchSpec spec;
    spec.binary = kFakeTrainer;
    spec.args = std::move(args);
    spec.log_path = absl::StrCat(dir_, "/logs/rank-0.log");
    return spec;
  }

  std::unique_ptr<TrainerProcess> LaunchOrDie(const LaunchSpec& spec) {
    absl::StatusOr<std::unique_ptr<TrainerProcess>> process = TrainerProcess::Launch(spec);
    EXPECT_THAT(process, IsOk());
    return process.ok() ? std::move(*process) : nullptr;
  }

  const std::string dir_ = ::tessera::testing::TestDir();
};

TEST_F(TrainerProcessTest, PassesEnvironmentArgsAndWorkingDirectory) {
  // An inherited RANK must be replaced, not duplicated.
  setenv("RANK", "99", /*overwrite=*/1);
  LaunchSpec spec = Spec({"--task=/work/x/rank-3.task.pb", "--exit=0"});
  spec.env = {
      {"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "2"}};
  spec.working_dir = absl::StrCat(dir_, "/run");
  std::filesystem::create_directories(spec.working_dir);
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  EXPECT_GT(process->pid(), 0);
  std::optional<ExitStatus> exit = WaitForExit(*process);
  unsetenv("RANK");
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 0);
  EXPECT_EQ(exit->signal, 0);

  const std::string log = ReadFile(spec.log_path);
  EXPECT_THAT(log, HasSubstr("RANK=3\n"));
  EXPECT_THAT(log, Not(HasSubstr("RANK=99")));
  EXPECT_THAT(log, HasSubstr("WORLD_SIZE=8\n"));
  EXPECT_THAT(log, HasSubstr("LOCAL_RANK=1\n"));
  EXPECT_THAT(log, HasSubstr("CUDA_VISIBLE_DEVICES=2\n"));
  EXPECT_THAT(log, HasSubstr("ARG[1]=--task=/work/x/rank-3.task.pb\n"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat(
                       "CWD=", std::filesystem::canonical(spec.working_dir).string(), "\n")));
}

TEST_F(TrainerProcessTest, ReportsExitCode) {
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(Spec({"--exit=7"}));
  ASSERT_NE(process, nullptr);
  std::optional<ExitStatus> exit = WaitForExit(*process);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 7);
  EXPECT_EQ(exit->signal, 0);
  // Reaped once; later calls report the same status.
  EXPECT_EQ(process->Poll()->exit_code, 7);
  EXPECT_EQ(process->Stop(absl::Seconds(1)).exit_code, 7);
}

TEST_F(TrainerProcessTest, PollIsEmptyWhileRunning) {
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(Spec({"--sleep=60"}));
  ASSERT_NE(process, nullptr);
  EXPECT_FALSE(process->Poll().has_value());
  EXPECT_EQ(kill(process->pid(), 0), 0);
}

TEST_F(TrainerProcessTest, ReportsCrashSignal) {
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(Spec({"--crash"}));
  ASSERT_NE(process, nullptr);
  std::optional<ExitStatus> exit = WaitForExit(*process);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->signal, SIGSEGV);
  EXPECT_EQ(exit->exit_code, -1);
}

TEST_F(TrainerProcessTest, StopWithSigtermReturnsBeforeGrace) {
  LaunchSpec spec = Spec({"--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  const absl::Time start = absl::Now();
  const ExitStatus exit = process->Stop(absl::Seconds(60));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(exit.signal, SIGTERM);
  EXPECT_EQ(exit.exit_code, -1);
  ExpectGroupGone(process->pid());
}

TEST_F(TrainerProcessTest, StopEscalatesToSigkillAfterGrace) {
  LaunchSpec spec = Spec({"--ignore_sigterm", "--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  const absl::Duration grace = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  const ExitStatus exit = process->Stop(grace);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, grace);
  EXPECT_LT(elapsed, grace + absl::Seconds(5));
  EXPECT_EQ(exit.signal, SIGKILL);
  // Idempotent: no second signal, same status.
  EXPECT_EQ(process->Stop(grace).signal, SIGKILL);
  EXPECT_EQ(process->Poll()->signal, SIGKILL);
  ExpectGroupGone(process->pid());
}

TEST_F(TrainerProcessTest, KillEndsAStoppedProcessWithoutWaiting) {
  // A hung rank: SIGSTOPped, so a SIGTERM would only be queued.
  LaunchSpec spec = Spec({"--spawn_child", "--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  ASSERT_EQ(kill(-process->pid(), SIGSTOP), 0);
  const absl::Time start = absl::Now();
  EXPECT_EQ(process->Kill().signal, SIGKILL);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(process->Stop(absl::Seconds(1)).signal, SIGKILL) << "idempotent";
  ExpectGroupGone(process->pid());
}

TEST_F(TrainerProcessTest, StopKillsGrandchildIgnoringSigterm) {
  LaunchSpec spec = Spec({"--spawn_child", "--ignore_sigterm", "--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  const pid_t pgid = process->pid();
  const pid_t grandchild = ChildPidFromLog(ReadFile(spec.log_path));
  ASSERT_GT(grandchild, 0);
  EXPECT_THAT(GroupMembers(pgid), Contains(grandchild));
  EXPECT_THAT(GroupMembers(pgid), Contains(pgid));

  EXPECT_EQ(process->Stop(absl::Milliseconds(200)).signal, SIGKILL);
  ExpectGroupGone(pgid);
  errno = 0;
  EXPECT_EQ(kill(grandchild, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

TEST_F(TrainerProcessTest, StopKillsGrandchildWithSigterm) {
  LaunchSpec spec = Spec({"--spawn_child", "--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  const pid_t grandchild = ChildPidFromLog(ReadFile(spec.log_path));
  ASSERT_GT(grandchild, 0);
  EXPECT_EQ(process->Stop(absl::Seconds(30)).signal, SIGTERM);
  ExpectGroupGone(process->pid());
}

TEST_F(TrainerProcessTest, ExitOfLeaderKillsLeftoverGrandchild) {
  // The fake exits at once; its grandchild would sleep for an hour.
  LaunchSpec spec = Spec({"--spawn_child", "--exit=3"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  std::optional<ExitStatus> exit = WaitForExit(*process);
  ASSERT_TRUE(exit.has_value());
  EXPECT_EQ(exit->exit_code, 3);
  ASSERT_GT(ChildPidFromLog(ReadFile(spec.log_path)), 0);
  ExpectGroupGone(process->pid());
}

TEST_F(TrainerProcessTest, DestructorLeavesNoOrphan) {
  LaunchSpec spec = Spec({"--spawn_child", "--ignore_sigterm", "--sleep=60"});
  std::unique_ptr<TrainerProcess> process = LaunchOrDie(spec);
  ASSERT_NE(process, nullptr);
  ASSERT_TRUE(WaitForLog(spec.log_path, "READY\n"));
  const pid_t pgid = process->pid();
  ASSERT_GT(ChildPidFromLog(ReadFile(spec.log_path)), 0);
  ASSERT_THAT(GroupMembers(pgid), Not(IsEmpty()));
  process.reset();
  ExpectGroupGone(pgid);
}

TEST_F(TrainerProcessTest, MissingBinaryIsNotFound) {
  LaunchSpec spec = Spec({});
  spec.binary = absl::StrCat(dir_, "/no-such-trainer");
  EXPECT_THAT(TrainerProcess::Launch(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(spec.binary)));
  spec.binary = "tessera-no-such-trainer-on-path";
  EXPECT_THAT(TrainerProcess::Launch(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(spec.binary)));
}

TEST_F(TrainerProcessTest, MissingWorkingDirectoryIsNotFound) {
  LaunchSpec spec = Spec({});
  spec.working_dir = absl::StrCat(dir_, "/no-such-dir");
  EXPECT_THAT(TrainerProcess::Launch(spec),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(spec.working_dir)));
}

TEST_F(TrainerProcessTest, LogTailReturnsLastLinesAndLogIsAppended) {
  LaunchSpec spec = Spec({"--lines=100"});
  std::unique_ptr<TrainerProcess> first = LaunchOrDie(spec);
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(WaitForExit(*first).has_value());
  // stderr lines are flushed before READY goes to stdout.
  EXPECT_EQ(first->LogTail(3), "line 99\nline 100\nREADY\n");
  EXPECT_EQ(first->LogTail(1), "READY\n");

  spec.args = {"--exit=5"};
  std::unique_ptr<TrainerProcess> second = LaunchOrDie(spec);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(WaitForExit(*second).has_value());
  const std::string log = ReadFile(spec.log_path);
  EXPECT_THAT(log, HasSubstr("line 1\n"));
  EXPECT_THAT(log, HasSubstr("ARG[1]=--exit=5\n"));
  EXPECT_THAT(second->LogTail(2), "ARG[1]=--exit=5\nREADY\n");
}

TEST(WriteMessageFileTest, RoundTripsAndReplacesAtomically) {
  const std::string dir = ::tessera::testing::TestDir();
  const std::string path = absl::StrCat(dir, "/job/attempt-1/rank-0.task.pb");
  v1::TrainerTask task;
  task.set_job_id("job-42");
  task.mutable_assignment()->set_rank(3);
  task.mutable_assignment()->set_world_size(8);
  ASSERT_THAT(WriteMessageFile(path, task), IsOk());

  v1::TrainerTask read;
  ASSERT_TRUE(read.ParseFromString(ReadFile(path)));
  EXPECT_EQ(read.job_id(), "job-42");
  EXPECT_EQ(read.assignment().rank(), 3);
  EXPECT_EQ(read.assignment().world_size(), 8);

  task.set_job_id("job-43");
  ASSERT_THAT(WriteMessageFile(path, task), IsOk());
  ASSERT_TRUE(read.ParseFromString(ReadFile(path)));
  EXPECT_EQ(read.job_id(), "job-43");
  // No temporary file is left beside it.
  int files = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator(std::filesystem::path(path).parent_path())) {
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(WriteMessageFileTest, UnwritableDirectoryFails) {
  const std::string dir = ::tessera::testing::TestDir();
  const std::string blocker = absl::StrCat(dir, "/file");
  std::ofstream(blocker) << "x";
  v1::TrainerTask task;
  EXPECT_THAT(WriteMessageFile(absl::StrCat(blocker, "/task.pb"), task), Not(IsOk()));
}

}  // namespace
}  // namespace tessera::worker
