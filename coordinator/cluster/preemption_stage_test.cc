// The preemption stage on its own, without a queue file, on a full cluster: a job of higher
// priority that the scheduler could not place asks a lower one to save a checkpoint and stop (a
// write to PREEMPTED, its own reason naming the victim, the victim moving); one of equal
// priority preempts nothing; while a victim is still stopping, nothing more is decided.
#include "coordinator/cluster/preemption_stage.h"

#include "coordinator/cluster/pass_fixture.h"

namespace tessera::coordinator {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

class PreemptionStageTest : public PassFixture {
 protected:
  // Runs the stage for the jobs the scheduler could not place now.
  void Preempt(PreemptionStage& stage, std::map<std::string, std::string>* reasons,
               std::vector<JobManager::TransitionRequest>* writes) {
    std::unique_ptr<Proposal> proposal = Propose();
    ASSERT_THAT(proposal->result.placed, IsEmpty());
    std::map<std::string, std::string> queue_of;
    for (const GangRequest& request : proposal->planned.requests) {
      queue_of[request.job_id] = proposal->planned.jobs.at(request.job_id)->queue();
    }
    GuardedLedger::Hold held(ledger_.get());
    stage.RunLocked(held, *state_, proposal->snapshot, {}, proposal->planned.requests, queue_of,
                    reasons, writes);
  }
};

TEST_F(PreemptionStageTest, AHigherPriorityJobPreemptsALowerOneOnAFullCluster) {
  Register("n1", 2);
  const std::string low = Submit(2, 0, /*priority=*/0);
  ASSERT_THAT(PlaceAll(), SizeIs(1));
  const std::string high = Submit(2, 0, /*priority=*/5);
  PreemptionStage stage(nodes_.get(), fate_.get());
  std::map<std::string, std::string> reasons;
  std::vector<JobManager::TransitionRequest> writes;
  Preempt(stage, &reasons, &writes);

  ASSERT_THAT(writes, SizeIs(1));
  EXPECT_EQ(writes[0].job_id, low);
  EXPECT_EQ(writes[0].state, v1::JOB_STATE_PREEMPTED);
  EXPECT_THAT(reasons[high], HasSubstr("waiting for " + low + " to save a checkpoint and stop"));
  {
    GuardedLedger::Hold held(ledger_.get());
    const Allocation* victim = held->Find(low);
    ASSERT_NE(victim, nullptr);
    EXPECT_EQ(victim->phase(), Allocation::Phase::kMoving);
    EXPECT_THAT(victim->preempted, HasSubstr("preempted by " + high));
  }
  EXPECT_EQ(stage.counts().at("default").at("priority"), 1);

  // The victim still stops: a second pass decides nothing more.
  reasons.clear();
  writes.clear();
  Preempt(stage, &reasons, &writes);
  EXPECT_THAT(writes, IsEmpty());
}

TEST_F(PreemptionStageTest, AnEqualPriorityPreemptsNothing) {
  Register("n1", 2);
  ASSERT_THAT((Submit(2), PlaceAll()), SizeIs(1));
  Submit(2);
  PreemptionStage stage(nodes_.get(), fate_.get());
  std::map<std::string, std::string> reasons;
  std::vector<JobManager::TransitionRequest> writes;
  Preempt(stage, &reasons, &writes);
  EXPECT_THAT(writes, IsEmpty());
  EXPECT_THAT(reasons, IsEmpty());
  EXPECT_THAT(stage.counts(), IsEmpty());
}

}  // namespace
}  // namespace tessera::coordinator
