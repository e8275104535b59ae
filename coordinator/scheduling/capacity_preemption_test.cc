#include "coordinator/scheduling/capacity_preemption.h"

#include <deque>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A CPU node with `total` slots of which `free` are free.
NodeCapacity CpuNode(const std::string& id, int total, int free) {
  NodeCapacity node;
  node.node_id = id;
  node.host = id;
  node.total_cpu_slots = total;
  node.free_cpu_slots = free;
  return node;
}

// A running CPU job of `queue` at `priority` holding `slots` slots on `node`; its ranks are kept
// for the life of the test program (RunningGang points to them, as to an allocation's).
RunningGang Running(const std::string& id, const std::string& queue, int priority,
                    const std::string& node, int slots, absl::Duration since_checkpoint) {
  static std::deque<std::vector<v1::RankPlacement>> held;
  std::vector<v1::RankPlacement>& ranks = held.emplace_back();
  for (int r = 0; r < slots; ++r) {
    v1::RankPlacement& rank = ranks.emplace_back();
    rank.set_rank(r);
    rank.set_node_id(node);
    rank.set_gpu_index(-1);
  }
  return RunningGang{.job = {.job_id = id,
                             .queue = queue,
                             .priority = priority,
                             .use_gpus = false,
                             .devices = slots,
                             .since_checkpoint = since_checkpoint},
                     .ranks = &ranks};
}

GangRequest Waiting(const std::string& id, int priority, int slots) {
  GangRequest request;
  request.job_id = id;
  request.priority = priority;
  request.use_gpus = false;
  request.world_size = slots;
  request.tensor_parallel = 1;
  return request;
}

std::vector<std::string> VictimIds(const PreemptionDecision& decision) {
  std::vector<std::string> ids;
  for (const Victim& victim : decision.victims) ids.push_back(victim.job_id);
  return ids;
}

TEST(CapacityPreemptionTest, TheFewestLowerPriorityJobsOfTheQueueThatMakeRoom) {
  // Two 4-slot nodes, full: n1 holds low (priority 0, 2 slots, checkpointed 5 s ago) and mid
  // (priority 1, 2 slots); n2 holds other (queue vision, priority 0) and low2 (priority 0, 2
  // slots, 50 s since its checkpoint).
  const std::vector<NodeCapacity> full = {CpuNode("n1", 4, 0), CpuNode("n2", 4, 0)};
  const std::vector<RunningGang> running = {
      Running("low", "default", 0, "n1", 2, absl::Seconds(5)),
      Running("mid", "default", 1, "n1", 2, absl::Seconds(1)),
      Running("other", "vision", 0, "n2", 2, absl::Seconds(1)),
      Running("low2", "default", 0, "n2", 2, absl::Seconds(50))};
  // 2 slots for priority 5: the lowest priority, least progress lost first: low alone.
  PreemptionDecision two =
      SelectCapacityPreemption(running, Waiting("high", 5, 2), "default", full);
  EXPECT_THAT(VictimIds(two), ElementsAre("low"));
  EXPECT_EQ(two.victims[0].kind, PreemptionKind::kPriority);
  EXPECT_THAT(two.victims[0].reason, HasSubstr("preempted by higher-priority high (priority 5)"));
  // 4 slots in one gang: low then low2 free 2 slots on each node, which places a 4-rank CPU
  // gang across both; never `other`, of another queue.
  PreemptionDecision four =
      SelectCapacityPreemption(running, Waiting("high", 5, 4), "default", full);
  EXPECT_THAT(VictimIds(four), ElementsAre("low", "low2"));
  // Equal priority preempts nothing; neither does a job that all the candidates cannot make room
  // for (8 slots while `other` keeps 2).
  EXPECT_THAT(SelectCapacityPreemption(running, Waiting("peer", 0, 2), "default", full).victims,
              IsEmpty());
  PreemptionDecision eight =
      SelectCapacityPreemption(running, Waiting("huge", 5, 8), "default", full);
  EXPECT_THAT(eight.victims, IsEmpty());
  EXPECT_THAT(eight.reason, HasSubstr("would not make room for huge"));
}

TEST(CapacityPreemptionTest, FreeDevicesCountSoFewerVictimsAreTaken) {
  // One free slot on n1 already: a 3-slot job needs only low's 2.
  const std::vector<NodeCapacity> capacity = {CpuNode("n1", 5, 1)};
  const std::vector<RunningGang> running = {
      Running("low", "default", 0, "n1", 2, absl::Seconds(5)),
      Running("low2", "default", 0, "n1", 2, absl::Seconds(9))};
  EXPECT_THAT(
      VictimIds(SelectCapacityPreemption(running, Waiting("high", 1, 3), "default", capacity)),
      ElementsAre("low"));
}

}  // namespace
}  // namespace tessera::coordinator
