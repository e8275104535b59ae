#include "trainer/report/worker_lifeline.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

TEST(DieWithWorkerTest, OkWhileTheParentIsTheWorker) {
  // Forked, so the parent-death signal is armed in a child, not in the test runner.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(DieWithWorker(std::to_string(getppid())).ok() ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(DieWithWorkerTest, RefusesWhenTheParentIsAnotherProcess) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  // A worker pid that is not the parent: as if the worker died before the trainer got here.
  if (child == 0) {
    const absl::Status status = DieWithWorker(std::to_string(getppid() + 100000));
    _exit(status.code() == absl::StatusCode::kFailedPrecondition ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(DieWithWorkerTest, RejectsANonPid) {
  EXPECT_THAT(DieWithWorker("worker"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("TESSERA_WORKER_PID")));
  EXPECT_THAT(DieWithWorker("0"), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(DieWithWorkerTest, TrainerIsKilledWhenTheWorkerDies) {
  // This test stands in for init: the "trainer" is re-parented to it when its "worker" dies.
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), 0);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t worker = fork();
  ASSERT_GE(worker, 0);
  if (worker == 0) {
    const pid_t trainer = fork();
    if (trainer == 0) {
      if (!DieWithWorker(std::to_string(getppid())).ok()) _exit(3);
      const char armed = 1;
      if (write(ready[1], &armed, 1) != 1) _exit(4);
      sleep(60);
      _exit(0);  // reached only if the parent-death signal never came
    }
    char armed = 0;
    if (read(ready[0], &armed, 1) != 1) _exit(5);
    if (write(ready[1], &trainer, sizeof(trainer)) != sizeof(trainer)) _exit(6);
    _exit(0);  // the worker dies
  }
  close(ready[1]);
  int status = 0;
  ASSERT_EQ(waitpid(worker, &status, 0), worker);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  pid_t trainer = 0;
  ASSERT_EQ(read(ready[0], &trainer, sizeof(trainer)), static_cast<ssize_t>(sizeof(trainer)));
  close(ready[0]);
  ASSERT_EQ(waitpid(trainer, &status, 0), trainer);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the trainer outlived its worker";
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

}  // namespace
}  // namespace tessera::trainer
