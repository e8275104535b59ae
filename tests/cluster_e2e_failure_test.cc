// The whole system when something fails, end to end on loopback: the coordinator killed and
// restarted mid-training, a trainer that cannot start, a rank killed (with and without restarts),
// a loss that turns NaN on every attempt, a stopped (hung) rank, and a cancel that must stop the
// trainers.


#include <signal.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(ClusterTest, NothingIsLostWhileTheCoordinatorRestarts) {
  const std::string job_id = Submit(Spec(300));
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_RUNNING, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();

  // kill -9 the coordinator mid-training; the trainers go on, the worker
  // keeps their reports. Restart it on the same address and state once the trainers have gone
  // 10 steps past what the coordinator knew (the worker's own metrics tell): those reports were
  // made while it was down.
  const int64_t known_step = Get(job_id).current_step();
  ASSERT_THAT(coordinator_->Stop(SIGKILL), IsOk());
  coordinator_.reset();
  int64_t trained = -1;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        trained = WorkerStep(worker_metrics_port_, job_id);
        return trained >= known_step + 10;
      },
      absl::Seconds(120), absl::Milliseconds(100)))
      << "the worker's last step " << trained << ", the coordinator's " << known_step;
  auto coordinator =
      Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=" + address_,
                         "--metrics_listen=", "--state=" + dir_.path() + "/state.db",
                         "--checkpoint_root=" + dir_.path() + "/ckpt",
                         absl::StrCat("--master_port_base=", 40000 + (getpid() % 2000) * 10)});
  ASSERT_THAT(coordinator, IsOk());
  coordinator_.emplace(std::move(*coordinator));
  ASSERT_EQ(Address(*coordinator_), address_);

  job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  v1::GetMetricsRequest metrics;
  metrics.set_job_id(job_id);
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), metrics, &curve).ok());
  // Every step, once, in order: the reports made while the coordinator was
  // down were relayed after it came back.
  ASSERT_EQ(curve.points_size(), 300);
  for (int i = 0; i < curve.points_size(); ++i) EXPECT_EQ(curve.points(i).step(), i + 1);
}

TEST_F(ClusterTest, ATrainerFailureFailsTheJobWithItsReason) {
  v1::JobSpec spec = Spec(20);
  // Validation cannot see the workers' file systems; the trainers can.
  spec.mutable_data()->set_train_shards(0, dir_.path() + "/missing/*.bin");
  v1::Job job = WaitFor(Submit(spec), v1::JOB_STATE_FAILED, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_DATA_ERROR);
  EXPECT_THAT(job.reason(), HasSubstr("missing/*.bin"));
  EXPECT_EQ(job.failure().node_id(), "e2e-node");
}

TEST_F(ClusterTest, KilledRankRestartsAndRetrainsTheLostStepsExactly) {
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  // The kill waits for a committed checkpoint at step 10 or later. Waiting for step 15 instead
  // let the kill land, on a loaded machine, before the asynchronous save of step 10 committed,
  // and the retry began at 0.
  ASSERT_TRUE(WaitForCheckpoint(job_id, 10, 120)) << Get(job_id).ShortDebugString();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(kill(rank1[0], SIGKILL), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  EXPECT_EQ(job.restarts(), 1) << job.ShortDebugString();
  ASSERT_EQ(job.attempts_size(), 2) << worker_->stderr_text();
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("rank 1 on e2e-node was killed by signal 9"));
  EXPECT_EQ(job.attempts(0).failure().rank(), 1);
  EXPECT_GE(job.attempts(1).start_step(), 10) << "resumed from a checkpoint";
  EXPECT_TRUE(TrainerPids(dir_.path() + "/e2e-node/jobs/" + job_id + "/attempt-0").empty());

  // The curve has every step once; the watch stream shows the restart between the attempts.
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  std::vector<std::string> transitions;
  for (const auto& event : Events(job_id)) {
    if (event.has_state_change()) {
      transitions.push_back(v1::JobState_Name(event.state_change().new_state()));
    }
  }
  EXPECT_THAT(transitions, ::testing::ElementsAre("JOB_STATE_PENDING", "JOB_STATE_SCHEDULED",
                                                  "JOB_STATE_RUNNING", "JOB_STATE_RESTARTING",
                                                  "JOB_STATE_SCHEDULED", "JOB_STATE_RUNNING",
                                                  "JOB_STATE_SUCCEEDED"));

  // The same job without the failure: the retrained steps have the same losses.
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

TEST_F(ClusterTest, WithoutRestartsTheKilledRankIsBlamedNotItsPeer) {
  const std::string job_id = Submit(Spec(100000));
  ASSERT_TRUE(WaitForStep(job_id, 3, 120)) << Get(job_id).reason();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  ASSERT_EQ(kill(rank1[0], SIGKILL), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_FAILED, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().signal(), 9);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_PROCESS_EXIT);
  EXPECT_THAT(job.reason(), HasSubstr("rank 1 on e2e-node was killed by signal 9"));
  EXPECT_EQ(job.restarts(), 0);
}

// Trainers whose loss turns NaN at step 4 of every attempt (fault injection through the worker's
// environment): the job restarts from its checkpoint until max_restarts is spent, then fails with
// every attempt's reason kept.
class DivergingClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    worker_env_ = {"TESSERA_FAULT_NAN_LOSS_AT_STEP=4"};
    ClusterTest::SetUp();
  }
};

TEST_F(DivergingClusterTest, AJobFailingAlikeEveryAttemptStopsAfterMaxRestarts) {
  v1::JobSpec spec = Spec(20);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_FAILED, 180);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.reason();
  EXPECT_EQ(job.restarts(), 2);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NAN_LOSS);
  ASSERT_EQ(job.attempts_size(), 3) << job.ShortDebugString();
  for (int i = 0; i < job.attempts_size(); ++i) {
    // Every rank holds the all-reduced loss, so either may be the first to report it.
    EXPECT_EQ(job.attempts(i).attempt(), i);
    EXPECT_THAT(job.attempts(i).reason(), HasSubstr("NAN_LOSS: loss is nan at step 4")) << i;
  }
  // The diverged step reached the metrics: its loss is NaN, once, and the steps before it are
  // there once each.
  v1::GetMetricsRequest request;
  request.set_job_id(job_id);
  v1::GetMetricsResponse curve;
  ASSERT_TRUE(stub_->GetMetrics(Context().get(), request, &curve).ok());
  ASSERT_EQ(curve.points_size(), 4);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(curve.points(i).step(), i + 1);
  EXPECT_TRUE(std::isnan(curve.points(3).loss()));
}

TEST_F(ClusterTest, StoppedRankIsFoundHungAndTheJobRestarts) {
  v1::JobSpec spec = Spec(40);
  spec.set_max_restarts(1);
  spec.set_hang_timeout_seconds(3);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();
  std::vector<pid_t> rank1 = TrainerPids(RankTask("e2e-node", job_id, 0, 1));
  ASSERT_EQ(rank1.size(), 1u);
  const absl::Time stopped = absl::Now();
  ASSERT_EQ(kill(rank1[0], SIGSTOP), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  const v1::TrainerFailure& hang = job.attempts(0).failure();
  EXPECT_EQ(hang.kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  EXPECT_EQ(hang.rank(), 1);
  EXPECT_THAT(hang.message(), HasSubstr("stopped"));
  const absl::Time detected =
      absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(hang.time()));
  EXPECT_LE(detected - stopped, absl::Seconds(3 + 2)) << "hang_timeout + 2 s";
  EXPECT_TRUE(TrainerPids(dir_.path() + "/e2e-node/jobs/" + job_id + "/attempt-0").empty());
}

TEST_F(ClusterTest, CancelStopsTheTrainers) {
  const std::string job_id = Submit(Spec(100000));
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_RUNNING, 60);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();

  v1::CancelJobRequest cancel;
  cancel.set_job_id(job_id);
  v1::CancelJobResponse cancelled;
  ASSERT_TRUE(stub_->CancelJob(Context().get(), cancel, &cancelled).ok());
  // The worker gets the stop order with its next heartbeat and the trainers
  // go; the slots are free again.
  bool listed = true;
  const bool freed = testing::WaitUntil(
      [&] {
        v1::ListNodesResponse nodes;
        listed = stub_->ListNodes(Context().get(), {}, &nodes).ok();
        return !listed ||
               (nodes.nodes(0).free_cpu_slots() == 2 && nodes.nodes(0).job_ids().empty());
      },
      absl::Seconds(20), absl::Milliseconds(100));
  ASSERT_TRUE(listed);
  EXPECT_TRUE(freed);
  // ("[t]ask" keeps pgrep from matching the shell that runs it.)
  auto pgrep = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir_.path() + "' || true"});
  ASSERT_THAT(pgrep, IsOk());
  const bool gone = testing::WaitUntil(
      [&] {
        pgrep = RunCommand({"/bin/sh", "-c", "pgrep -f '[t]ask=" + dir_.path() + "' || true"});
        return pgrep.ok() && pgrep->output.empty();
      },
      absl::Seconds(10), absl::Milliseconds(100));
  EXPECT_TRUE(gone) << "trainer processes left: " << (pgrep.ok() ? pgrep->output : "?");
}

}  // namespace
}  // namespace tessera
