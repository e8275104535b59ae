// The store and announce stages on their own: a stored placement is SCHEDULED in the store and
// its held orders go out, with its scheduling latency and queue wait observed; a placement whose
// job was cancelled before it was stored is taken back: no order goes out, no device stays held.
#include "coordinator/cluster/store_stage.h"

#include <vector>

#include "coordinator/cluster/pass_fixture.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

using StoreStageTest = PassFixture;

TEST_F(StoreStageTest, AStoredPlacementIsScheduledAndAnnounced) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  clock_.Advance(absl::Seconds(3));
  std::unique_ptr<Proposal> proposal = Propose();
  const Reservation reservation = Reserve(*proposal);
  ASSERT_THAT(reservation.placements, SizeIs(1));
  StoreStage stage(state_.get(), ledger_.get(), jobs_.get());
  std::vector<double> latencies;
  std::vector<std::pair<std::string, double>> waits;
  stage.SetSchedulingLatencyObserver([&](double seconds) { latencies.push_back(seconds); });
  stage.SetQueueWaitObserver(
      [&](const std::string& queue, double seconds) { waits.emplace_back(queue, seconds); });

  EXPECT_THAT(stage.Store(Writes(*proposal, reservation)), ElementsAre(job_id));
  const v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(job.placements(), SizeIs(2));
  EXPECT_EQ(job.master_port(), reservation.master_ports.at(job_id));
  bool storing = true;
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_FALSE(storing);
  EXPECT_THAT(Orders("n1").start(), SizeIs(1));
  EXPECT_THAT(latencies, ElementsAre(3.0));
  EXPECT_THAT(waits, ElementsAre(std::pair<std::string, double>("default", 3.0)));
}

TEST_F(StoreStageTest, APlacementWhoseJobWasCancelledIsTakenBack) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  std::unique_ptr<Proposal> proposal = Propose();
  const Reservation reservation = Reserve(*proposal);
  ASSERT_THAT(reservation.placements, SizeIs(1));
  ASSERT_THAT(jobs_->Cancel(job_id, "changed my mind").status(), ::tessera::testing::IsOk());

  StoreStage stage(state_.get(), ledger_.get(), jobs_.get());
  EXPECT_THAT(stage.Store(Writes(*proposal, reservation)), IsEmpty());
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_FALSE(Allocated(job_id));
  EXPECT_THAT(Orders("n1").start(), SizeIs(0));
}

}  // namespace
}  // namespace tessera::coordinator
