// AllocationLedger's device counts and Allocation's node checks against slow recounts: after random
// sequences of Add (new and replacing), Erase and EraseIf, Used() must equal the devices the
// allocations' ranks name, HeldByQueue() the devices each queue's allocations hold, and
// AllNodesIn / AllNodesEnded must agree with a walk over Nodes() (all are kept or computed
// without walking every allocation or building the node list, on every pass and heartbeat).
#include "coordinator/cluster/allocation_ledger.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

UsedResources Recount(AllocationLedger& ledger) {
  std::map<std::string, std::set<int>> gpus;
  std::map<std::string, int> cpu_slots;
  for (const auto& [job_id, allocation] : ledger.all()) {
    for (const auto& rank : allocation.ranks) {
      if (rank.gpu_index() >= 0) {
        gpus[rank.node_id()].insert(rank.gpu_index());
      } else {
        ++cpu_slots[rank.node_id()];
      }
    }
  }
  return UsedResources::FromMaps(gpus, cpu_slots);
}

// Ranks on `cluster_nodes` nodes; GPU indexes up to `max_gpu` (64 and above are held outside the
// bit set).
Allocation RandomAllocation(std::mt19937& rng, int cluster_nodes = 6, int max_gpu = 3) {
  Allocation allocation;
  const int nodes = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int n = 0; n < nodes; ++n) {
    const std::string node_id =
        absl::StrCat("n", std::uniform_int_distribution<int>(0, cluster_nodes - 1)(rng));
    const int ranks = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int r = 0; r < ranks; ++r) {
      v1::RankPlacement& rank = allocation.ranks.emplace_back();
      rank.set_rank(static_cast<int>(allocation.ranks.size()) - 1);
      rank.set_node_id(node_id);
      // -1: a CPU slot. Indexes repeat across allocations on purpose (a doubled placement must
      // not free a device the other still holds).
      const int gpu = std::uniform_int_distribution<int>(-1, max_gpu)(rng);
      rank.set_gpu_index(gpu > 3 ? 60 + gpu : gpu);
    }
  }
  return allocation;
}

// `cluster_nodes` nodes and `jobs` job ids; GPU indexes up to 60 + `max_gpu`.
void CheckUsedAgainstRecounts(int cluster_nodes, int jobs, int max_gpu) {
  std::mt19937 rng(20261125);
  AllocationLedger ledger;
  for (int step = 0; step < 2000; ++step) {
    const std::string job_id =
        absl::StrCat("job-", std::uniform_int_distribution<int>(0, jobs)(rng));
    switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
      case 0:
      case 1:
        ledger.Add(job_id, RandomAllocation(rng, cluster_nodes, max_gpu));
        break;
      case 2:
        ledger.Erase(job_id);
        break;
      default: {
        const int parity = std::uniform_int_distribution<int>(0, 1)(rng);
        ledger.EraseIf([&](const std::string& id, const Allocation&) {
          return static_cast<int>(id.size() % 2) == parity;
        });
      }
    }
    const UsedResources expected = Recount(ledger);
    const UsedResources used = ledger.Used();
    ASSERT_EQ(used.GpuSets(), expected.GpuSets()) << "step " << step;
    ASSERT_EQ(used.CpuSlotCounts(), expected.CpuSlotCounts()) << "step " << step;
    ASSERT_EQ(used.nodes.size(), expected.nodes.size()) << "step " << step;
    for (size_t i = 0; i < used.nodes.size(); ++i) {
      ASSERT_EQ(used.nodes[i].node_id, expected.nodes[i].node_id) << "step " << step;
    }
  }
  ledger.EraseIf([](const std::string&, const Allocation&) { return true; });
  EXPECT_TRUE(ledger.Used().nodes.empty());
}

TEST(AllocationLedgerTest, UsedMatchesTheRanksHeld) { CheckUsedAgainstRecounts(6, 20, 3); }

// Hundreds of nodes, most of them emptied again and again (the kept holdings are compacted), and
// GPU indexes beyond the 64 of the bit set.
TEST(AllocationLedgerTest, UsedMatchesTheRanksHeldOnManyNodes) {
  CheckUsedAgainstRecounts(400, 60, 6);
}

// Allocation::queue -> (allocations, devices held), walking every allocation.
std::map<std::string, std::pair<int64_t, Resources>> RecountQueues(AllocationLedger& ledger) {
  std::map<std::string, std::pair<int64_t, Resources>> held;
  for (const auto& [job_id, allocation] : ledger.all()) {
    auto& [allocations, resources] = held[allocation.queue];
    ++allocations;
    for (const auto& rank : allocation.ranks) {
      ++(rank.gpu_index() >= 0 ? resources.gpus : resources.cpu_slots);
    }
  }
  return held;
}

TEST(AllocationLedgerTest, QueueHoldsMatchARecount) {
  std::mt19937 rng(20261129);
  // "" is a job stored before queues existed; "default" the implicit queue.
  const std::vector<std::string> queues = {"", "default", "nlp", "vision", "a-very-long-queue"};
  AllocationLedger ledger;
  for (int step = 0; step < 3000; ++step) {
    const std::string job_id = absl::StrCat("job-", std::uniform_int_distribution<int>(0, 30)(rng));
    switch (std::uniform_int_distribution<int>(0, 4)(rng)) {
      case 0:
      case 1:
      case 2: {
        // Replacing an allocation may move the job to another queue.
        Allocation allocation = RandomAllocation(rng);
        allocation.queue = queues[std::uniform_int_distribution<size_t>(0, queues.size() - 1)(rng)];
        if (std::uniform_int_distribution<int>(0, 19)(rng) == 0) allocation.ranks.clear();
        ledger.Add(job_id, std::move(allocation));
        break;
      }
      case 3:
        ledger.Erase(job_id);
        break;
      default: {
        const int modulus = std::uniform_int_distribution<int>(2, 5)(rng);
        ledger.EraseIf([&](const std::string& id, const Allocation&) {
          return static_cast<int>(id.size() + id.back()) % modulus == 0;
        });
      }
    }
    const auto expected = RecountQueues(ledger);
    const auto& held = ledger.HeldByQueue();
    ASSERT_EQ(held.size(), expected.size()) << "step " << step;
    for (const auto& [queue, hold] : held) {
      auto it = expected.find(queue);
      ASSERT_NE(it, expected.end()) << "step " << step << ", queue '" << queue << "'";
      EXPECT_EQ(hold.allocations, it->second.first) << "step " << step << ", queue " << queue;
      EXPECT_EQ(hold.held, it->second.second) << "step " << step << ", queue " << queue;
    }
  }
  ledger.EraseIf([](const std::string&, const Allocation&) { return true; });
  EXPECT_TRUE(ledger.HeldByQueue().empty());
}

TEST(AllocationTest, NodeChecksAgreeWithTheNodeList) {
  std::mt19937 rng(7);
  const std::vector<v1::TaskState> states = {v1::TASK_STATE_RUNNING, v1::TASK_STATE_SUCCEEDED,
                                             v1::TASK_STATE_FAILED, v1::TASK_STATE_STARTING,
                                             v1::TASK_STATE_STOPPED};
  for (int trial = 0; trial < 500; ++trial) {
    Allocation allocation = RandomAllocation(rng);
    // Interleave the nodes' ranks at times: a node's ranks need not be adjacent.
    if (trial % 3 == 0) std::shuffle(allocation.ranks.begin(), allocation.ranks.end(), rng);
    const std::vector<std::string> nodes = allocation.Nodes();
    // What was set, walked below without the allocation's counts: reports come in rounds and
    // change a node's state again (and may name a node that has no rank of the attempt).
    std::map<std::string, v1::TaskState> reported;
    std::set<std::string> lost;
    for (int round = 0; round < 4; ++round) {
      for (const std::string& node : {nodes.front(), nodes.back(), std::string("stranger")}) {
        const int pick = std::uniform_int_distribution<int>(0, 5)(rng);
        if (pick < 5) {
          allocation.SetTaskState(node, states[pick]);
          reported[node] = states[pick];
        }
        if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {
          allocation.MarkLost(node);
          lost.insert(node);
        }
      }
      for (v1::TaskState state : states) {
        bool all_in = true;
        for (const std::string& node : nodes) {
          auto it = reported.find(node);
          all_in = all_in && it != reported.end() && it->second == state;
        }
        EXPECT_EQ(allocation.AllNodesIn(state), all_in) << "trial " << trial << " round " << round;
      }
      bool all_ended = true;
      for (const std::string& node : nodes) {
        auto it = reported.find(node);
        const bool ended = lost.contains(node) ||
                           (it != reported.end() && (it->second == v1::TASK_STATE_SUCCEEDED ||
                                                     it->second == v1::TASK_STATE_FAILED ||
                                                     it->second == v1::TASK_STATE_STOPPED));
        EXPECT_EQ(allocation.NodeEnded(node), ended) << "trial " << trial << " round " << round;
        all_ended = all_ended && ended;
      }
      EXPECT_EQ(allocation.AllNodesEnded(), all_ended) << "trial " << trial << " round " << round;
      // A copy (a decision's record of the attempt) answers alike.
      const Allocation copy = allocation;
      EXPECT_EQ(copy.AllNodesEnded(), all_ended);
    }
  }
}

}  // namespace
}  // namespace tessera::coordinator
