// A stale attempt cannot commit a checkpoint, end to end on loopback: a one-rank job's node
// freezes (its worker and its trainer SIGSTOPped) after a checkpoint, the coordinator gives the
// node up and restarts the job on the other worker as attempt 1, which raises the checkpoint
// directory's fence (trainer/io/checkpoint_fence.h) and trains to the end, committing every
// checkpoint. The frozen trainer is then let go: its next commit, which would replace one of
// attempt 1's, is refused by the fence and it ends; attempt 1's checkpoints stay as they were and
// the job's losses are those of an undisturbed run.

#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"
#include "trainer/io/checkpoint.h"
#include "trainer/io/checkpoint_fence.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, 'Z' zombie...); 0 when gone.
char ProcessState(pid_t pid) {
  const std::string stat = ReadText(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return 0;
  return stat[paren + 2];
}

// The modification time of `path` in nanoseconds; -1 when it cannot be read.
int64_t ModifiedNanos(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return -1;
  return static_cast<int64_t>(info.st_mtim.tv_sec) * 1000000000 + info.st_mtim.tv_nsec;
}

class FenceTest : public TwoWorkerClusterTest {};

// The modification times of the manifests of every checkpoint under `root`.
std::map<std::string, int64_t> ManifestTimes(const std::string& root) {
  std::map<std::string, int64_t> times;
  for (const std::string& dir : trainer::ListCheckpointDirs(root)) {
    times[dir] = ModifiedNanos(dir + "/" + trainer::kManifestFileName);
  }
  return times;
}

TEST_F(FenceTest, AFrozenAttemptWokenAfterARestartCannotCommit) {
  // Long enough that the trainer is far from done when it is frozen after step 5 (steps of a few
  // milliseconds on an idle machine), short enough for a loaded one (steps of seconds).
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.mutable_checkpoint()->set_interval_steps(5);
  spec.mutable_resources()->set_cpu_slots(1);
  spec.set_max_restarts(2);
  spec.mutable_checkpoint()->set_keep_last(0);  // every checkpoint stays for the stale one to hit
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  const std::string root = dir_.path() + "/ckpt/" + job_id;
  // The checkpoint as the trainer commits it, not as its report reaches the coordinator (the
  // worker relays reports on its poll interval: a fast trainer would be done by then).
  ASSERT_TRUE(testing::WaitUntil([&] { return !trainer::ListCheckpointDirs(root).empty(); },
                                 absl::Seconds(120), absl::Milliseconds(2)))
      << Get(job_id).ShortDebugString();

  // Freeze the node that runs attempt 0: its worker first, so that nothing reacts to the stopped
  // trainer, then the trainer, wherever it is (between saves or in one).
  int frozen = -1;
  std::vector<pid_t> stale;
  for (int w = 0; w < 2 && stale.empty(); ++w) {
    stale = TrainerPids(absl::StrCat(dir_.path(), "/", WorkerName(w), "/jobs/", job_id,
                                     "/attempt-0/"));
    frozen = w;
  }
  ASSERT_EQ(stale.size(), 1u);
  Subprocess& frozen_worker = frozen == 0 ? *worker_ : *worker2_;
  ASSERT_EQ(kill(frozen_worker.pid(), SIGSTOP), 0);
  // Whatever fails below, the worker runs again for TearDown to stop it.
  absl::Cleanup thaw = [&] {
    kill(stale[0], SIGCONT);
    kill(frozen_worker.pid(), SIGCONT);
  };
  ASSERT_EQ(kill(stale[0], SIGSTOP), 0);
  const std::string stale_log = absl::StrCat(dir_.path(), "/", WorkerName(frozen), "/jobs/",
                                             job_id, "/attempt-0/rank-0.log");

  // The coordinator gives the frozen node up (its heartbeat timeout, 3 s) and restarts the job
  // on the other worker, which resumes from the newest checkpoint and trains to the end,
  // committing a checkpoint every 5 steps: among them the one the stale trainer saves next.
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  const std::string new_log = absl::StrCat(dir_.path(), "/", WorkerName(1 - frozen), "/jobs/",
                                           job_id, "/attempt-1/rank-0.log");
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED)
      << job.ShortDebugString() << "\nattempt 1:\n" << ReadText(new_log);
  ASSERT_EQ(job.attempts_size(), 2) << job.ShortDebugString();
  EXPECT_GE(job.attempts(1).start_step(), 5);
  absl::StatusOr<trainer::CheckpointFence> fence = trainer::ReadCheckpointFence(root);
  ASSERT_THAT(fence, IsOk());
  EXPECT_TRUE(fence->present);
  EXPECT_EQ(fence->job_id, job_id);
  EXPECT_EQ(fence->attempt, 1);
  const std::map<std::string, int64_t> before = ManifestTimes(root);
  ASSERT_EQ(before.rbegin()->first, root + "/" + trainer::CheckpointDirName(kSteps));

  // Let the stale trainer go (its worker stays frozen, so nothing stops it): it trains on to its
  // next save (or finishes the one it was in), which the fence refuses, and the trainer ends.
  ASSERT_EQ(kill(stale[0], SIGCONT), 0);
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        const char state = ProcessState(stale[0]);
        return state == 0 || state == 'Z';
      },
      absl::Seconds(120), absl::Milliseconds(50)))
      << "the stale trainer still runs\n" << ReadText(stale_log);
  EXPECT_THAT(ReadText(stale_log),
              HasSubstr(absl::StrCat("checkpoint write refused: attempt 0 of job ", job_id,
                                     " is fenced off by attempt 1 of job ", job_id, " in ",
                                     root, "/FENCE")));
  ASSERT_EQ(kill(frozen_worker.pid(), SIGCONT), 0);
  std::move(thaw).Cancel();

  // Attempt 1's checkpoints are all there, untouched, and verify.
  EXPECT_EQ(ManifestTimes(root), before);
  for (const auto& [dir, unused] : before) {
    EXPECT_THAT(trainer::VerifyCheckpoint(dir), IsOk()) << dir;
  }
  EXPECT_EQ(trainer::ReadCheckpointFence(root)->attempt, 1);

  // Every step once, and the losses of an undisturbed run: the stale trainer's steps after the
  // freeze never reached the curve.
  job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.attempts_size(), 2);
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

}  // namespace
}  // namespace tessera
