// Step metrics outlive the reports that carried them, end to end: a 2-rank CPU job checkpoints
// every 5 steps; the coordinator is killed -9, so the worker keeps its trainers' reports (its
// Report calls are refused: no report waits in a socket the coordinator would read later) while
// they train and commit checkpoints on; then the machine is lost: the trainers and the worker are
// killed -9 with those reports queued. The coordinator restarts on its state, a new worker
// registers, and the job restarts from the newest checkpoint, which is past every step the
// coordinator recorded. Its rank 0 reports the lost steps again from the checkpoint's
// step_metrics.pb, so the job SUCCEEDS with a metric point for every step 1..max_steps, and the
// points of the lost steps are the first attempt's. Again with two workers, where the attempt
// that reports them again runs on the other node than the lost one. And a job started on another
// job's checkpoint directory reports none of that job's steps, on its first attempt or a restart.
//
// The coordinator is killed rather than stopped (SIGSTOP): a stopped process's sockets still take
// the worker's retried Report calls, each carrying every queued report, and the coordinator reads
// them all once it resumes, so nothing would be lost and nothing reported again.

#include <signal.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"
#include "trainer/io/checkpoint.h"

namespace tessera {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::testing::HasSubstr;

// The step of the newest complete checkpoint under `root`; 0 when there is none.
int64_t NewestCheckpointStep(const std::string& root) {
  const std::vector<std::string> dirs = trainer::ListCheckpointDirs(root);
  if (dirs.empty()) return 0;
  int64_t step = 0;
  const std::string& newest = dirs.front();
  if (!absl::SimpleAtoi(newest.substr(newest.rfind("step-") + 5), &step)) return 0;
  return step;
}

// The record a restarted coordinator kept of a job (`kept`, its curve): steps 1..`*recorded` with
// no gap, at least `before` (what it held when it was killed) and short of the `resumed`
// checkpoint, so that the steps after it are the lost ones.
void ReadRecordShortOf(const std::vector<v1::StepMetrics>& kept, int64_t before, int64_t resumed,
                       int64_t* recorded) {
  *recorded = static_cast<int64_t>(kept.size());
  ASSERT_GE(*recorded, before);
  ASSERT_LT(*recorded, resumed);
  ASSERT_EQ(kept.empty() ? 0 : kept.back().step(), *recorded);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_F(ClusterTest, StepsWhoseReportsDiedWithTheirWorkerAreReportedAgainFromTheCheckpoint) {
  constexpr int kSteps = 80;
  v1::JobSpec spec = Spec(kSteps);
  spec.mutable_checkpoint()->set_interval_steps(5);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  ASSERT_TRUE(WaitForStep(job_id, 8, 120)) << Get(job_id).reason();

  // The coordinator goes: the worker keeps the reports while training goes on.
  const int64_t recorded_before = static_cast<int64_t>(Curve(job_id).size());
  ASSERT_THAT(coordinator_->Stop(SIGKILL), IsOk());
  coordinator_.reset();
  const std::string checkpoints = dir_.path() + "/ckpt/" + job_id;
  int64_t lost_from = 0;
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        lost_from = NewestCheckpointStep(checkpoints);
        return lost_from >= recorded_before + 15;
      },
      absl::Seconds(60), absl::Milliseconds(50)))
      << "newest checkpoint: step " << lost_from << ", recorded: step " << recorded_before;

  // The machine is lost: its trainers and its worker die with the reports queued.
  const std::vector<pid_t> trainers = TrainerPids(dir_.path() + "/e2e-node/");
  ASSERT_EQ(trainers.size(), 2u);
  for (pid_t pid : trainers) ::kill(pid, SIGKILL);
  ASSERT_THAT(worker_->Stop(SIGKILL), IsOk());
  worker_.reset();
  const absl::Time lost = absl::Now();
  // The newest checkpoint once the trainers are gone: where the next attempt resumes.
  const int64_t resumed = NewestCheckpointStep(checkpoints);
  ASSERT_GE(resumed, recorded_before + 15);
  StartCoordinator();
  ASSERT_FALSE(HasFatalFailure());
  int64_t recorded = 0;
  ASSERT_NO_FATAL_FAILURE(ReadRecordShortOf(Curve(job_id), recorded_before, resumed, &recorded));

  StartWorker(0, 1);
  ASSERT_FALSE(HasFatalFailure());
  const v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 180);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  ASSERT_GE(job.restarts(), 1);

  // Every step once, with no gap.
  const std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  // The steps the coordinator had not recorded up to the resumed checkpoint were trained by the
  // lost attempt, before the machine was lost, and reported again from the checkpoint.
  const absl::Time lost_time = lost;
  for (int64_t step = recorded + 1; step <= resumed; ++step) {
    const v1::StepMetrics& point = curve[step - 1];
    EXPECT_LT(absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(point.time())), lost_time)
        << "step " << step;
    EXPECT_GT(point.loss(), 0) << "step " << step;
  }
  // The new attempt's rank 0 says what it reported again.
  const std::string log = ReadText(absl::StrCat(dir_.path(), "/e2e-node/jobs/", job_id, "/attempt-",
                                                job.attempt(), "/rank-0.log"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("again from the checkpoint's step_metrics.pb")));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("stay missing"))) << log;
}

// Two workers of one slot each and a 1-rank job: the node that runs it is lost (its trainer and
// its worker killed -9) while the coordinator, killed -9, misses the steps after `recorded`. The
// restart goes to the other node, which has never run the job: its rank 0 reads the lost
// steps from the checkpoint's step_metrics.pb in the shared checkpoint root and reports them.
TEST_F(TwoWorkerClusterTest, StepsLostWithTheirNodeAreReportedAgainByAnAttemptOnAnotherNode) {
  // Enough steps that the coordinator is killed while training goes on: a 1-rank step of this
  // model takes milliseconds on an idle machine, and 40 steps were over before it learned of
  // step 8.
  constexpr int kSteps = 200;
  v1::JobSpec spec = Spec(kSteps);
  spec.mutable_checkpoint()->set_interval_steps(5);
  spec.mutable_resources()->set_cpu_slots(1);
  // One rank: half the fixture's batch keeps its steps as short as the 2-rank case's.
  spec.mutable_batch()->set_global_batch_size(4);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  ASSERT_TRUE(WaitForStep(job_id, 8, 120)) << Get(job_id).reason();
  int lost_worker = -1;
  std::vector<pid_t> trainers;
  for (int w = 0; w < 2 && trainers.empty(); ++w) {
    trainers = TrainerPids(absl::StrCat(dir_.path(), "/", WorkerName(w), "/jobs/", job_id, "/"));
    lost_worker = w;
  }
  ASSERT_EQ(trainers.size(), 1u);
  const std::string other_node = WorkerName(1 - lost_worker);

  const int64_t recorded_before = static_cast<int64_t>(Curve(job_id).size());
  ASSERT_THAT(coordinator_->Stop(SIGKILL), IsOk());
  coordinator_.reset();
  const std::string checkpoints = dir_.path() + "/ckpt/" + job_id;
  int64_t newest = 0;
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        newest = NewestCheckpointStep(checkpoints);
        return newest >= recorded_before + 15;
      },
      absl::Seconds(60), absl::Milliseconds(50)))
      << "newest checkpoint: step " << newest << ", recorded: step " << recorded_before;

  ::kill(trainers[0], SIGKILL);
  std::optional<Subprocess>& lost = lost_worker == 0 ? worker_ : worker2_;
  ASSERT_THAT(lost->Stop(SIGKILL), IsOk());
  lost.reset();
  const absl::Time lost_time = absl::Now();
  const int64_t resumed = NewestCheckpointStep(checkpoints);
  ASSERT_GE(resumed, recorded_before + 15);
  StartCoordinator();
  ASSERT_FALSE(HasFatalFailure());
  int64_t recorded = 0;
  ASSERT_NO_FATAL_FAILURE(ReadRecordShortOf(Curve(job_id), recorded_before, resumed, &recorded));

  const v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 180);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  ASSERT_GE(job.attempts_size(), 2);
  const v1::JobAttempt& last = job.attempts(job.attempts_size() - 1);
  ASSERT_EQ(last.node_ids_size(), 1);
  EXPECT_EQ(last.node_ids(0), other_node);

  // Every step exactly once.
  const std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  // The steps up to the resumed checkpoint that the stopped coordinator missed are the lost
  // node's points, reported by the other node.
  for (int64_t step = recorded + 1; step <= resumed; ++step) {
    const v1::StepMetrics& point = curve[step - 1];
    EXPECT_LT(absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(point.time())), lost_time)
        << "step " << step;
  }
  const std::string log = ReadText(absl::StrCat(dir_.path(), "/", other_node, "/jobs/", job_id,
                                                "/attempt-", job.attempt(), "/rank-0.log"));
  EXPECT_THAT(log, HasSubstr("again from the checkpoint's step_metrics.pb")) << log;
  EXPECT_THAT(log, ::testing::Not(HasSubstr("stay missing"))) << log;
}

// Job A trains 10 steps into a directory and succeeds; job B, given the same directory, resumes
// from A's step 10, checkpoints every 5 steps and is restarted once (its trainers killed -9 after
// a checkpoint past step 15). The coordinator's record of B begins at step 11, so the restart is
// told it is complete through step 0 and replays what B's checkpoint carries: B's own steps only.
// B's curve is steps 11..30, each once; none of A's steps 1..10, and B's first attempt says why.
TEST_F(ClusterTest, AJobStartedOnAnotherJobsCheckpointsReportsNoneOfThatJobsSteps) {
  const std::string shared = dir_.path() + "/shared-ckpt";
  v1::JobSpec first = Spec(10);
  first.mutable_checkpoint()->set_directory(shared);
  const std::string a = Submit(first);
  ASSERT_FALSE(a.empty());
  const v1::Job done = WaitFor(a, v1::JOB_STATE_SUCCEEDED, 120);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  ASSERT_EQ(NewestCheckpointStep(shared), 10);
  ASSERT_EQ(Curve(a).size(), 10u);

  constexpr int kSteps = 30;
  v1::JobSpec second = Spec(kSteps);
  second.mutable_checkpoint()->set_directory(shared);
  second.mutable_checkpoint()->set_interval_steps(5);
  second.set_max_restarts(2);
  const std::string b = Submit(second);
  ASSERT_FALSE(b.empty());
  ASSERT_TRUE(WaitForCheckpoint(b, 15, 120)) << Get(b).ShortDebugString();
  const std::vector<pid_t> trainers =
      TrainerPids(absl::StrCat(dir_.path(), "/e2e-node/jobs/", b, "/attempt-0/"));
  ASSERT_EQ(trainers.size(), 2u);
  for (pid_t pid : trainers) ::kill(pid, SIGKILL);

  const v1::Job job = WaitFor(b, v1::JOB_STATE_SUCCEEDED, 180);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  ASSERT_GE(job.restarts(), 1);
  const std::vector<v1::StepMetrics> curve = Curve(b);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps - 10));
  for (int i = 0; i < kSteps - 10; ++i) EXPECT_EQ(curve[i].step(), 11 + i);
  const std::string log =
      ReadText(absl::StrCat(dir_.path(), "/e2e-node/jobs/", b, "/attempt-0/rank-0.log"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("resumed from a checkpoint of job ", a, " (step 10)")))
      << log;
  // The restart reports B's own points again (its record reads as complete through step 0) and
  // says why steps 1..10 are not among them.
  const std::string restart_log = ReadText(
      absl::StrCat(dir_.path(), "/e2e-node/jobs/", b, "/attempt-", job.attempt(), "/rank-0.log"));
  EXPECT_THAT(restart_log, HasSubstr("steps 1..10 stay missing: the attempts that wrote the "
                                     "checkpoint started above them"))
      << restart_log;
}

}  // namespace
}  // namespace tessera
