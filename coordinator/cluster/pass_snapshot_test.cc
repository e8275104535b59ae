// The snapshot stage on its own: the waiting jobs that already hold devices (a restart whose
// failed attempt still drains, a placement not yet stored) are left out; the devices in use and
// the registry's generation are taken; with queues, each queue's holds are counted under the
// queue in force.
#include "coordinator/cluster/pass_snapshot.h"

#include "coordinator/cluster/pass_fixture.h"
#include "coordinator/queues/queue_config.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

using PassSnapshotTest = PassFixture;

TEST_F(PassSnapshotTest, TakesTheWaitingJobsWithoutDevicesAndTheDevicesInUse) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string first = Submit(2);
  std::unique_ptr<Proposal> proposal = Propose();
  ASSERT_THAT(Reserve(*proposal).placements, SizeIs(1));  // reserved, not yet stored
  const std::string second = Submit(2);

  const PassSnapshot snapshot = Snapshot(Waiting());
  EXPECT_THAT(snapshot.waiting, ElementsAre(second));
  ASSERT_NE(snapshot.summaries, nullptr);
  EXPECT_THAT(*snapshot.summaries, SizeIs(2));
  int64_t slots_used = 0;
  for (const auto& [node, slots] : snapshot.used.CpuSlotCounts()) slots_used += slots;
  EXPECT_EQ(slots_used, 2);
  EXPECT_EQ(snapshot.generation, nodes_->generation());
  EXPECT_EQ(snapshot.queues, nullptr);
  EXPECT_THAT(snapshot.queue_use, IsEmpty());
}

TEST_F(PassSnapshotTest, CountsEachQueuesHoldsUnderTheQueueInForce) {
  Register("n1", 4);
  ASSERT_THAT(
      (Submit(2), PlaceAll()),
      SizeIs(1));  // stored with the implicit queue, which counts as the file's default_queue
  absl::StatusOr<QueueConfig> config = ParseQueueConfig(R"(
default_queue: shared
queues:
  - name: shared
    nominal: {cpu_slots: 4}
)");
  ASSERT_THAT(config.status(), ::tessera::testing::IsOk());
  auto queues = std::make_shared<const QueueConfig>(*std::move(config));
  GuardedLedger::Hold held(ledger_.get());
  const PassSnapshot snapshot = TakePassSnapshotLocked(held, *state_, *nodes_, {}, queues);
  EXPECT_EQ(snapshot.queues, queues);
  EXPECT_EQ(snapshot.queue_use.at("shared").cpu_slots, 2);
  EXPECT_THAT(snapshot.waiting, IsEmpty());
  EXPECT_EQ(snapshot.summaries, nullptr);  // nothing waits: no capacity taken
}

}  // namespace
}  // namespace tessera::coordinator
