// The reservation stage on its own: a placement becomes an allocation whose orders wait, held
// back, until the placement is stored; a gang on a node that registered again since the snapshot
// is not reserved.
#include "coordinator/cluster/reservation_stage.h"

#include "coordinator/cluster/pass_fixture.h"
#include "coordinator/scheduling/assignments.h"

namespace tessera::coordinator {
namespace {

using ::testing::SizeIs;

using ReservationStageTest = PassFixture;

TEST_F(ReservationStageTest, APlacementBecomesAnAllocationWithItsOrdersHeldBack) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  std::unique_ptr<Proposal> proposal = Propose();
  ASSERT_THAT(proposal->result.placed, SizeIs(1));

  const Reservation reservation = Reserve(*proposal);
  ASSERT_THAT(reservation.placements, SizeIs(1));
  EXPECT_EQ(reservation.placements[0]->job_id, job_id);
  const int port = reservation.master_ports.at(job_id);
  EXPECT_GE(port, state_->options.base_master_port);
  bool storing = false;
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_TRUE(storing);
  // Held back: nothing goes out before the placement is stored.
  EXPECT_THAT(Orders("n1").start(), SizeIs(0));
  {
    GuardedLedger::Hold held(ledger_.get());
    EXPECT_TRUE(state_->orders.ReleaseStart("n1", TaskId(job_id, 0, "n1")));
  }
  const v1::HeartbeatResponse orders = Orders("n1");
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), port);
  EXPECT_THAT(orders.start(0).trainers(), SizeIs(2));
}

TEST_F(ReservationStageTest, AGangOnANodeThatRegisteredAgainWaitsForTheNextPass) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  std::unique_ptr<Proposal> proposal = Propose();
  ASSERT_THAT(proposal->result.placed, SizeIs(1));
  Register("n1", 2);  // a restarted worker: its devices may differ from the snapshot's

  const Reservation reservation = Reserve(*proposal);
  EXPECT_THAT(reservation.placements, SizeIs(0));
  EXPECT_FALSE(Allocated(job_id));
  EXPECT_THAT(Orders("n1").start(), SizeIs(0));
}

}  // namespace
}  // namespace tessera::coordinator
