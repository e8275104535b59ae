// The coordinator's half of the loss-spike guard (JobSpec.guard), in process: an attempt that ends
// with FAILURE_KIND_LOSS_SPIKE rolls the job back to its last checkpoint without counting a
// restart, records a Rollback (event and Job.rollbacks) with rank 0's spike report, hands every
// later attempt the skipped data in its task, and fails the job past guard.max_rollbacks with a
// reason naming every spike's step.
#include <string>
#include <vector>

#include "coordinator/cluster/cluster_fixture.h"
#include "coordinator/jobs/attempt_policy.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

v1::JobSpec GuardedSpec(int max_rollbacks, int skip_batches) {
  v1::JobSpec spec = CpuSpec(1, /*max_restarts=*/0);
  spec.mutable_guard()->set_loss_spike_factor(3);
  spec.mutable_guard()->set_max_rollbacks(max_rollbacks);
  spec.mutable_guard()->set_skip_batches(skip_batches);
  return spec;
}

v1::TrainerReport SpikeReport(int64_t step, double loss, double median) {
  v1::TrainerReport report;
  v1::LossSpike* spike = report.mutable_loss_spike();
  spike->set_step(step);
  spike->set_loss(loss);
  spike->set_loss_median(median);
  spike->set_cause(absl::StrCat("loss ", loss, " at step ", step));
  return report;
}

class LossGuardRollbackTest : public ClusterTest {
 protected:
  // The spike's failure as the trainer reports it: the step it finished last (the spike's - 1).
  static v1::TaskStatus SpikeFailure(const std::string& job_id, int attempt, int64_t spike_step,
                                     absl::Time now) {
    v1::TaskStatus failed = Task(job_id, attempt, "n1", v1::TASK_STATE_FAILED);
    *failed.mutable_failure() = Failure(v1::FAILURE_KIND_LOSS_SPIKE, 0, "n1", now,
                                        absl::StrCat("loss spike at step ", spike_step));
    failed.mutable_failure()->set_step(spike_step - 1);
    return failed;
  }
  // The spec of the start order `node` gets next (the attempt's task).
  v1::JobSpec NextTaskSpec(const std::string& node) {
    v1::HeartbeatResponse orders = Beat(node, {});
    EXPECT_THAT(orders.start(), SizeIs(1));
    if (orders.start().empty() || orders.start(0).trainers().empty()) return {};
    return orders.start(0).trainers(0).spec();
  }
  void Running(const std::string& job_id, int attempt) {
    Beat("n1", {Task(job_id, attempt, "n1", v1::TASK_STATE_RUNNING)});
  }
};

TEST_F(LossGuardRollbackTest, SpikeRollsBackToTheCheckpointAndSkipsTheBatchFromThenOn) {
  Register("n1", 1);
  const std::string job_id = Submit(GuardedSpec(/*max_rollbacks=*/2, /*skip_batches=*/3));
  cluster_->Tick();
  EXPECT_THAT(NextTaskSpec("n1").guard().skipped(), SizeIs(0));
  Running(job_id, 0);
  ASSERT_THAT(
      Relay("n1", job_id, 0, 1,
            {Step(1, 5.0), Step(2, 4.0), CheckpointAt(2), Step(3, 3.5), SpikeReport(4, 350.0, 4.0)})
          .status(),
      IsOk());
  Beat("n1", {SpikeFailure(job_id, 0, 4, Now())});
  cluster_->Tick();

  v1::Job job = Job(job_id);
  EXPECT_EQ(job.restarts(), 0) << "a rollback is not a restart (max_restarts is 0)";
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.current_step(), 2);
  ASSERT_THAT(job.rollbacks(), SizeIs(1));
  const v1::Rollback& rollback = job.rollbacks(0);
  EXPECT_EQ(rollback.attempt(), 0);
  EXPECT_EQ(rollback.resume_step(), 2);
  EXPECT_EQ(rollback.spike().step(), 4);
  EXPECT_DOUBLE_EQ(rollback.spike().loss(), 350.0);
  EXPECT_DOUBLE_EQ(rollback.spike().loss_median(), 4.0);
  EXPECT_EQ(rollback.skipped().step(), 4);
  EXPECT_EQ(rollback.skipped().batches(), 3);
  ASSERT_THAT(job.attempts(), SizeIs(1));
  EXPECT_EQ(job.attempts(0).failure().kind(), v1::FAILURE_KIND_LOSS_SPIKE);
  // The event stream holds the rollback with its figures.
  std::vector<int64_t> rollback_steps;
  for (const v1::JobEvent& event : Events(job_id)) {
    if (event.has_rollback()) rollback_steps.push_back(event.rollback().spike().step());
  }
  EXPECT_THAT(rollback_steps, ElementsAre(4));

  // The next attempt's task skips the batches; the spec as submitted is unchanged.
  v1::JobSpec task_spec = NextTaskSpec("n1");
  ASSERT_THAT(task_spec.guard().skipped(), SizeIs(1));
  EXPECT_EQ(task_spec.guard().skipped(0).step(), 4);
  EXPECT_EQ(task_spec.guard().skipped(0).batches(), 3);
  EXPECT_THAT(Job(job_id).spec().guard().skipped(), SizeIs(0));
  Running(job_id, 1);
  ASSERT_THAT(Relay("n1", job_id, 1, 1, {Step(3, 3.4), Step(4, 3.0)}).status(), IsOk());
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(LossGuardRollbackTest, PastMaxRollbacksTheJobFailsNamingTheSpikesSteps) {
  Register("n1", 1);
  const std::string job_id = Submit(GuardedSpec(/*max_rollbacks=*/2, /*skip_batches=*/1));
  cluster_->Tick();
  const std::vector<int64_t> spike_steps = {5, 7, 9};
  for (int attempt = 0; attempt < 3; ++attempt) {
    v1::JobSpec task_spec = NextTaskSpec("n1");
    // Every earlier rollback's skip is in the task, oldest first.
    ASSERT_THAT(task_spec.guard().skipped(), SizeIs(attempt));
    for (int i = 0; i < attempt; ++i) {
      EXPECT_EQ(task_spec.guard().skipped(i).step(), spike_steps[i]);
    }
    Running(job_id, attempt);
    // No spike report this time: the attempt waits failure_settle for it (past blame_grace: a
    // loaded worker's report stream lags), then the rollback takes the step from the failure.
    Beat("n1", {SpikeFailure(job_id, attempt, spike_steps[attempt], Now())});
    cluster_->Tick();
    EXPECT_EQ(Job(job_id).attempt(), attempt) << "decided before the report could come";
    clock_.Advance(absl::Seconds(1));
    cluster_->Tick();
    EXPECT_EQ(Job(job_id).attempt(), attempt) << "decided at blame_grace, the report still due";
    clock_.Advance(absl::Seconds(4));
    cluster_->Tick();
  }
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_THAT(job.rollbacks(), SizeIs(2));
  EXPECT_EQ(job.rollbacks(1).spike().step(), 7);
  EXPECT_THAT(job.reason(), HasSubstr("loss spikes at steps 5, 7, 9: no rollbacks left "
                                      "(guard.max_rollbacks 2)"));
  EXPECT_EQ(FreeSlots("n1"), 1);
}

TEST(AttemptPolicyGuardTest, DefaultsAndTheRollbackReason) {
  v1::Job job;
  job.mutable_spec()->mutable_guard();
  EXPECT_EQ(GuardMaxRollbacks(job.spec().guard()), 3);
  EXPECT_EQ(GuardSkipBatches(job.spec().guard()), 1);
  v1::TrainerFailure failure;
  failure.set_kind(v1::FAILURE_KIND_LOSS_SPIKE);
  failure.set_step(11);
  failure.set_message("loss is nan at step 12");
  SpikeDecision decision = DecideSpike(job, 4, failure, std::nullopt, /*resume_step=*/10);
  ASSERT_TRUE(decision.rollback.has_value());
  EXPECT_EQ(decision.rollback->spike().step(), 12);
  EXPECT_EQ(decision.rollback->skipped().batches(), 1);
  EXPECT_EQ(decision.reason,
            "loss spike: loss is nan at step 12; rolling back to the checkpoint of step 10 and "
            "skipping 1 global batch(es) at step 12 (rollback 1 of 3)");
}

}  // namespace
}  // namespace tessera::coordinator
