// The settle stage on its own: the attempt of a job no longer active is drained (its stop goes
// out) and its devices are freed only once its every task has ended; an ended attempt of a job
// still active frees its devices and asks the pass to list the waiting jobs again.
#include "coordinator/cluster/settle_stage.h"

#include "coordinator/cluster/pass_fixture.h"
#include "coordinator/scheduling/assignments.h"

namespace tessera::coordinator {
namespace {

using ::testing::IsEmpty;
using ::testing::SizeIs;

class SettleStageTest : public PassFixture {
 protected:
  // Marks every task of `job_id`'s attempt ended, as the worker protocol does on their reports.
  void EndTasks(const std::string& job_id) {
    GuardedLedger::Hold held(ledger_.get());
    Allocation* allocation = held->Find(job_id);
    ASSERT_NE(allocation, nullptr);
    for (const std::string& node : allocation->Nodes()) {
      allocation->SetTaskState(node, v1::TASK_STATE_STOPPED);
    }
  }
};

TEST_F(SettleStageTest, AnInactiveJobsAttemptIsDrainedAndFreedOnceItsTasksEnded) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  ASSERT_THAT(PlaceAll(), SizeIs(1));
  Orders("n1");  // the start went out
  ASSERT_THAT(jobs_->Cancel(job_id, "done with it").status(), ::tessera::testing::IsOk());
  const absl::flat_hash_set<std::string_view> active;  // the job is no longer listed

  {
    GuardedLedger::Hold held(ledger_.get());
    EXPECT_THAT(SettleLocked(held, *fate_, /*count=*/true, clock_.Now(), &active), IsEmpty());
    EXPECT_EQ(held->Find(job_id)->phase(), Allocation::Phase::kDraining);
    EXPECT_FALSE(FreeEndedLocked(held, *fate_, {}, &active));
  }
  const v1::HeartbeatResponse orders = Orders("n1");
  ASSERT_THAT(orders.stop(), SizeIs(1));
  EXPECT_EQ(orders.stop(0), TaskId(job_id, 0, "n1"));
  EXPECT_TRUE(Allocated(job_id));  // its tasks still run

  EndTasks(job_id);
  {
    GuardedLedger::Hold held(ledger_.get());
    EXPECT_FALSE(FreeEndedLocked(held, *fate_, {}, &active));
  }
  EXPECT_FALSE(Allocated(job_id));
}

TEST_F(SettleStageTest, AnEndedAttemptOfAnActiveJobAsksForTheWaitingJobsAgain) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  ASSERT_THAT(PlaceAll(), SizeIs(1));
  {
    GuardedLedger::Hold held(ledger_.get());
    fate_->DrainLocked(held, job_id, *held->Find(job_id));
  }
  EndTasks(job_id);
  absl::flat_hash_set<std::string_view> active;  // views of the listing, as the pass's
  active.insert(job_id);
  GuardedLedger::Hold held(ledger_.get());
  EXPECT_TRUE(FreeEndedLocked(held, *fate_, {}, &active));
  EXPECT_EQ(held->Find(job_id), nullptr);
}

TEST_F(SettleStageTest, WithoutTheListingEveryAllocationIsLeftAsItIs) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  ASSERT_THAT(PlaceAll(), SizeIs(1));
  GuardedLedger::Hold held(ledger_.get());
  EXPECT_THAT(SettleLocked(held, *fate_, /*count=*/false, clock_.Now(), nullptr), IsEmpty());
  EXPECT_FALSE(FreeEndedLocked(held, *fate_, {}, nullptr));
  ASSERT_NE(held->Find(job_id), nullptr);
  EXPECT_EQ(held->Find(job_id)->phase(), Allocation::Phase::kRunning);
}

}  // namespace
}  // namespace tessera::coordinator
