// The loss-spike guard end to end: coordinator, worker and real trainers on loopback. A poisoned
// global batch (kFaultLossSpikeAtBatchEnv in the worker's environment) rolls the job back to its
// checkpoint, the next attempt skips the batch and the job succeeds with no restart counted; a
// divergence that no skip removes (the loss NaN from a step on) fails the job past
// guard.max_rollbacks with a reason naming the spikes' steps.
#include <string>

#include "absl/strings/str_cat.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

class SpikingClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    worker_env_ = {absl::StrCat(kFaultLossSpikeAtBatchEnv, "=8")};
    ClusterTest::SetUp();
  }
};

TEST_F(SpikingClusterTest, APoisonedBatchIsRolledBackSkippedAndTheJobSucceeds) {
  v1::JobSpec spec = Spec(12);
  spec.mutable_checkpoint()->set_interval_steps(3);
  spec.mutable_guard()->set_loss_spike_factor(5);
  spec.mutable_guard()->set_window(3);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.rollbacks_size(), 1) << job.ShortDebugString();
  const v1::Rollback& rollback = job.rollbacks(0);
  EXPECT_EQ(rollback.spike().step(), 8);
  EXPECT_EQ(rollback.resume_step(), 6);
  EXPECT_EQ(rollback.skipped().step(), 8);
  EXPECT_EQ(rollback.skipped().batches(), 1);
  // Rank 0's report reached the coordinator before the rollback was decided.
  EXPECT_GT(rollback.spike().loss(), 5 * rollback.spike().loss_median());
  EXPECT_GT(rollback.spike().loss_median(), 0);
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_EQ(job.attempts(0).failure().kind(), v1::FAILURE_KIND_LOSS_SPIKE);
  EXPECT_EQ(job.attempts(1).start_step(), 6);
  EXPECT_EQ(job.current_step(), 12);
}

class DivergingGuardedClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    worker_env_ = {absl::StrCat(kFaultNanLossAtStepEnv, "=4")};
    ClusterTest::SetUp();
  }
};

TEST_F(DivergingGuardedClusterTest, PastMaxRollbacksTheJobFailsNamingTheSteps) {
  v1::JobSpec spec = Spec(10);
  spec.mutable_checkpoint()->set_interval_steps(2);
  spec.mutable_guard()->set_max_rollbacks(1);
  spec.set_max_restarts(3);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_FAILED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.reason();
  EXPECT_EQ(job.restarts(), 0) << "rollbacks do not spend max_restarts";
  EXPECT_EQ(job.rollbacks_size(), 1);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_LOSS_SPIKE);
  EXPECT_THAT(job.reason(), HasSubstr("loss spikes at steps 4, 4: no rollbacks left "
                                      "(guard.max_rollbacks 1); the last: loss is nan at step 4"));
}

}  // namespace
}  // namespace tessera
