// The ring of shard replicas over a job's nodes (shard_cache_peers.h).
#include "coordinator/nodes/shard_cache_peers.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

std::map<std::string, v1::TaskAssignment> TwoRanksPerNode(const std::vector<std::string>& nodes) {
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const std::string& node : nodes) {
    assignments[node].add_trainers();
    assignments[node].add_trainers();
  }
  return assignments;
}

std::vector<std::string> Peers(const v1::TrainerTask& task) {
  return {task.shard_cache_peers().begin(), task.shard_cache_peers().end()};
}

TEST(ShardCachePeersTest, RingOverThreeNodes) {
  auto assignments = TwoRanksPerNode({"a", "b", "c"});
  AssignShardCachePeers({{"a", "a:1"}, {"b", "b:1"}, {"c", "c:1"}}, assignments);
  for (const auto& task : assignments["a"].trainers()) {
    EXPECT_EQ(task.shard_replica_address(), "b:1");
    EXPECT_THAT(Peers(task), ElementsAre("b:1", "c:1"));
  }
  EXPECT_EQ(assignments["b"].trainers(1).shard_replica_address(), "c:1");
  EXPECT_THAT(Peers(assignments["b"].trainers(1)), ElementsAre("c:1", "a:1"));
  // The last node's replica wraps around to the first.
  EXPECT_EQ(assignments["c"].trainers(0).shard_replica_address(), "a:1");
  EXPECT_THAT(Peers(assignments["c"].trainers(0)), ElementsAre("a:1", "b:1"));
}

TEST(ShardCachePeersTest, OneNodeKeepsOnlyTheLocalCopy) {
  auto assignments = TwoRanksPerNode({"a"});
  AssignShardCachePeers({{"a", "a:1"}}, assignments);
  EXPECT_EQ(assignments["a"].trainers(0).shard_replica_address(), "");
  EXPECT_THAT(Peers(assignments["a"].trainers(0)), IsEmpty());
}

TEST(ShardCachePeersTest, NodeWithoutAnAddressIsLeftOutOfTheRing) {
  auto assignments = TwoRanksPerNode({"a", "b", "c"});
  AssignShardCachePeers({{"a", "a:1"}, {"c", "c:1"}}, assignments);
  EXPECT_EQ(assignments["a"].trainers(0).shard_replica_address(), "c:1");
  EXPECT_EQ(assignments["c"].trainers(0).shard_replica_address(), "a:1");
  EXPECT_EQ(assignments["b"].trainers(0).shard_replica_address(), "");
  EXPECT_THAT(Peers(assignments["b"].trainers(0)), IsEmpty());
}

}  // namespace
}  // namespace tessera::coordinator
