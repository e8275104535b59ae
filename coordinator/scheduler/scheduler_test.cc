#include "coordinator/scheduler/scheduler.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

constexpr char kH100[] = "NVIDIA H100 80GB HBM3";
constexpr char kA100[] = "NVIDIA A100-SXM4-40GB";

// A GPU node with `total` GPUs of which the lowest `free` indexes are free.
NodeCapacity GpuNode(const std::string& id, int total, int free, const std::string& gpu = kH100) {
  NodeCapacity node;
  node.node_id = id;
  node.host = absl::StrCat(id, ".cluster");
  node.gpu_name = gpu;
  node.total_gpus = total;
  for (int i = 0; i < free; ++i) node.free_gpus.push_back(i);
  node.total_cpu_slots = 4;
  node.free_cpu_slots = 4;
  return node;
}

NodeCapacity CpuNode(const std::string& id, int total_slots, int free_slots) {
  NodeCapacity node;
  node.node_id = id;
  node.host = absl::StrCat(id, ".cluster");
  node.total_cpu_slots = total_slots;
  node.free_cpu_slots = free_slots;
  return node;
}

GangRequest Gang(const std::string& id, int world, int tp = 1, int priority = 0,
                 int64_t order = 0) {
  GangRequest request;
  request.job_id = id;
  request.world_size = world;
  request.tensor_parallel = tp;
  request.priority = priority;
  request.submit_order = order;
  return request;
}

const GangPlacement* Find(const ScheduleResult& result, const std::string& job_id) {
  for (const GangPlacement& placement : result.placed) {
    if (placement.job_id == job_id) return &placement;
  }
  return nullptr;
}

// Ranks per node, e.g. {"a": 4, "b": 4}.
std::map<std::string, int> RanksPerNode(const GangPlacement& placement) {
  std::map<std::string, int> counts;
  for (const v1::RankPlacement& rank : placement.ranks) ++counts[rank.node_id()];
  return counts;
}

// Checks every invariant a placement must keep, independently of the packing choice: ranks in
// order, tensor-parallel groups on one node, local ranks 0.. per node in rank order, GPU indexes
// ascending and free in the input, no slot handed out twice in one pass, master_addr is rank 0's
// host.
void ExpectValidPass(const ScheduleResult& result, const std::vector<GangRequest>& requests,
                     const std::vector<NodeCapacity>& nodes) {
  std::map<std::string, const NodeCapacity*> by_id;
  for (const NodeCapacity& node : nodes) by_id[node.node_id] = &node;
  std::map<std::string, std::set<int>> gpus_taken;
  std::map<std::string, int> cpu_taken;
  for (const GangPlacement& placement : result.placed) {
    SCOPED_TRACE(placement.job_id);
    EXPECT_FALSE(result.pending_reasons.contains(placement.job_id));
    auto request = std::find_if(requests.begin(), requests.end(),
                                [&](const GangRequest& r) { return r.job_id == placement.job_id; });
    ASSERT_NE(request, requests.end());
    ASSERT_EQ(static_cast<int>(placement.ranks.size()), request->world_size);
    ASSERT_TRUE(by_id.contains(placement.ranks[0].node_id()));
    EXPECT_EQ(placement.master_addr, by_id[placement.ranks[0].node_id()]->host);
    std::map<std::string, int> next_local_rank;
    std::map<std::string, int> last_gpu;
    std::set<std::string> finished_nodes;
    std::string previous_node;
    for (int r = 0; r < request->world_size; ++r) {
      const v1::RankPlacement& rank = placement.ranks[r];
      const std::string& node_id = rank.node_id();
      ASSERT_TRUE(by_id.contains(node_id)) << node_id;
      const NodeCapacity& node = *by_id[node_id];
      EXPECT_TRUE(node.schedulable);
      EXPECT_EQ(rank.rank(), r);
      // Each node holds one contiguous block of ranks.
      if (node_id != previous_node) {
        EXPECT_FALSE(finished_nodes.contains(node_id)) << "node " << node_id << " revisited";
        if (!previous_node.empty()) finished_nodes.insert(previous_node);
        previous_node = node_id;
      }
      if (r % request->tensor_parallel != 0) {
        EXPECT_EQ(node_id, placement.ranks[r - 1].node_id()) << "tp group split at rank " << r;
      }
      EXPECT_EQ(rank.local_rank(), next_local_rank[node_id]++);
      if (request->use_gpus) {
        const int gpu = rank.gpu_index();
        EXPECT_NE(std::find(node.free_gpus.begin(), node.free_gpus.end(), gpu),
                  node.free_gpus.end())
            << "GPU " << gpu << " on " << node_id << " was not free";
        EXPECT_TRUE(gpus_taken[node_id].insert(gpu).second) << "GPU " << gpu << " given twice";
        if (last_gpu.contains(node_id)) {
          EXPECT_GT(gpu, last_gpu[node_id]);
        }
        last_gpu[node_id] = gpu;
      } else {
        EXPECT_EQ(rank.gpu_index(), -1);
        EXPECT_LE(++cpu_taken[node_id], node.free_cpu_slots);
      }
    }
  }
  // Every request is either placed or has a reason, never both.
  for (const GangRequest& request : requests) {
    EXPECT_NE(Find(result, request.job_id) != nullptr,
              result.pending_reasons.contains(request.job_id))
        << request.job_id;
  }
}

ScheduleResult CheckedSchedule(const std::vector<GangRequest>& requests,
                               const std::vector<NodeCapacity>& nodes) {
  ScheduleResult result = Schedule(requests, nodes);
  ExpectValidPass(result, requests, nodes);
  return result;
}

TEST(ScheduleTest, SingleNodeFits) {
  ScheduleResult result = CheckedSchedule({Gang("job", 4)}, {GpuNode("a", 8, 8)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(result.pending_reasons, IsEmpty());
  const GangPlacement& placement = result.placed[0];
  EXPECT_EQ(placement.job_id, "job");
  EXPECT_EQ(placement.master_addr, "a.cluster");
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(placement.ranks[r].node_id(), "a");
    EXPECT_EQ(placement.ranks[r].local_rank(), r);
    EXPECT_EQ(placement.ranks[r].gpu_index(), r);
  }
}

TEST(ScheduleTest, LocalRanksAndGpuIndexesFollowTheFreeGpus) {
  NodeCapacity a = GpuNode("a", 8, 0);
  a.free_gpus = {7, 3, 5, 1};  // unsorted on purpose
  NodeCapacity b = GpuNode("b", 8, 0);
  b.free_gpus = {6, 2};
  ScheduleResult result = CheckedSchedule({Gang("job", 6)}, {b, a});
  ASSERT_EQ(result.placed.size(), 1u);
  const GangPlacement& placement = result.placed[0];
  std::vector<std::tuple<std::string, int, int>> got;
  for (const v1::RankPlacement& rank : placement.ranks) {
    got.emplace_back(rank.node_id(), rank.local_rank(), rank.gpu_index());
  }
  // The larger block is filled first, so rank 0 and MASTER_ADDR are on a.
  EXPECT_THAT(got, ElementsAre(std::make_tuple("a", 0, 1), std::make_tuple("a", 1, 3),
                               std::make_tuple("a", 2, 5), std::make_tuple("a", 3, 7),
                               std::make_tuple("b", 0, 2), std::make_tuple("b", 1, 6)));
  EXPECT_EQ(placement.master_addr, "a.cluster");
}

TEST(ScheduleTest, MultiNodeGang) {
  ScheduleResult result =
      CheckedSchedule({Gang("job", 8)}, {GpuNode("a", 4, 4), GpuNode("b", 4, 4)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]), UnorderedElementsAre(Pair("a", 4), Pair("b", 4)));
  EXPECT_EQ(result.placed[0].ranks[0].node_id(), "a");
  EXPECT_EQ(result.placed[0].ranks[4].node_id(), "b");
  EXPECT_EQ(result.placed[0].ranks[4].local_rank(), 0);
  EXPECT_EQ(result.placed[0].master_addr, "a.cluster");
}

TEST(ScheduleTest, AllOrNothing) {
  struct Case {
    int world;
    int tp;
    std::string reason;
  };
  // Two nodes with 8 GPUs each, half of each held by running jobs: 8 free in all.
  const std::vector<Case> cases = {
      {9, 1, "needs 9 GPUs, largest free gang is 8"},
      {9, 3, "needs 9 GPUs in tensor_parallel groups of 3, largest free gang is 6"},
      {8, 8, "tensor_parallel 8 needs 8 GPUs on one node, largest node has 4 free"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("world ", c.world, " tp ", c.tp));
    ScheduleResult result =
        CheckedSchedule({Gang("big", c.world, c.tp)}, {GpuNode("a", 8, 4), GpuNode("b", 8, 4)});
    EXPECT_THAT(result.placed, IsEmpty());
    EXPECT_THAT(result.pending_reasons, ElementsAre(Pair("big", c.reason)));
  }
}

TEST(ScheduleTest, TensorParallelGroupsStayWithinANode) {
  ScheduleResult result =
      CheckedSchedule({Gang("job", 8, 4)}, {GpuNode("a", 4, 4), GpuNode("b", 4, 4)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]), UnorderedElementsAre(Pair("a", 4), Pair("b", 4)));

  // 3 + 3 + 2 free: a tp-2 gang of 6 can use only one group from each 3-free node, so it spans
  // all three nodes, and never puts half a group on a node.
  result = CheckedSchedule({Gang("job", 6, 2)},
                           {GpuNode("a", 4, 3), GpuNode("b", 4, 3), GpuNode("c", 4, 2)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]),
              UnorderedElementsAre(Pair("a", 2), Pair("b", 2), Pair("c", 2)));
}

TEST(ScheduleTest, PackingPrefersTheTightestFitAndFewestNodes) {
  struct Case {
    std::string name;
    std::vector<int> free;  // free GPUs of nodes n0, n1, ... (8 GPUs each)
    int world;
    int tp;
    std::map<std::string, int> expected;
  };
  const std::vector<Case> cases = {
      {"small job takes the small hole", {8, 2}, 2, 1, {{"n1", 2}}},
      {"tightest of three", {8, 4, 3}, 3, 1, {{"n2", 3}}},
      {"only the big node holds it", {8, 4}, 5, 1, {{"n0", 5}}},
      {"one full node beats three part nodes", {2, 2, 2, 8}, 8, 1, {{"n3", 8}}},
      {"largest first, remainder to the tightest", {6, 6, 4}, 10, 1, {{"n0", 6}, {"n2", 4}}},
      {"two nodes rather than three", {5, 5, 3, 3, 3}, 9, 1, {{"n0", 5}, {"n1", 4}}},
      {"groups count, not GPUs", {7, 4, 6}, 8, 4, {{"n1", 4}, {"n2", 4}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<NodeCapacity> nodes;
    for (size_t i = 0; i < c.free.size(); ++i) {
      nodes.push_back(GpuNode(absl::StrCat("n", i), 8, c.free[i]));
    }
    ScheduleResult result = CheckedSchedule({Gang("job", c.world, c.tp)}, nodes);
    ASSERT_EQ(result.placed.size(), 1u);
    EXPECT_EQ(RanksPerNode(result.placed[0]), c.expected);
  }
}

TEST(ScheduleTest, BestFitAvoidsFragmentation) {
  // Worst fit would put the 2-GPU job on a and leave no node with 8 free for the next job.
  std::vector<GangRequest> requests = {Gang("small", 2, 1, 0, 1), Gang("big", 8, 8, 0, 2)};
  ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 8, 8), GpuNode("b", 8, 6)});
  ASSERT_EQ(result.placed.size(), 2u);
  EXPECT_THAT(RanksPerNode(*Find(result, "small")), ElementsAre(Pair("b", 2)));
  EXPECT_THAT(RanksPerNode(*Find(result, "big")), ElementsAre(Pair("a", 8)));
}

TEST(ScheduleTest, FragmentedFreeGpusDoNotHoldATensorParallelGroup) {
  // Six GPUs free in all, but no node has four.
  ScheduleResult result =
      CheckedSchedule({Gang("job", 4, 4)}, {GpuNode("a", 4, 3), GpuNode("b", 4, 3)});
  EXPECT_THAT(result.placed, IsEmpty());
  EXPECT_THAT(result.pending_reasons,
              ElementsAre(Pair("job",
                               "tensor_parallel 4 needs 4 GPUs on one node, largest node "
                               "has 3 free")));
}

TEST(ScheduleTest, PriorityFirstThenFifo) {
  struct Case {
    std::string name;
    std::vector<GangRequest> requests;
    std::string winner;
  };
  const std::vector<Case> cases = {
      {"higher priority wins though newer",
       {Gang("low", 4, 1, 0, 1), Gang("high", 4, 1, 5, 2)},
       "high"},
      {"older wins within a priority",
       {Gang("newer", 4, 1, 3, 9), Gang("older", 4, 1, 3, 2)},
       "older"},
      {"negative priority runs last", {Gang("neg", 4, 1, -1, 1), Gang("zero", 4, 1, 0, 7)}, "zero"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<GangRequest> requests = c.requests;
    for (int flip = 0; flip < 2; ++flip) {
      ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 4, 4)});
      ASSERT_EQ(result.placed.size(), 1u);
      EXPECT_EQ(result.placed[0].job_id, c.winner);
      std::reverse(requests.begin(), requests.end());
    }
  }
}

TEST(ScheduleTest, PlacesInPriorityOrderWhileCapacityLasts) {
  std::vector<GangRequest> requests = {Gang("c", 2, 1, 0, 3), Gang("a", 2, 1, 9, 1),
                                       Gang("b", 2, 1, 9, 2)};
  ScheduleResult result = CheckedSchedule(requests, {GpuNode("n", 8, 6)});
  ASSERT_EQ(result.placed.size(), 3u);
  EXPECT_EQ(result.placed[0].job_id, "a");
  EXPECT_EQ(result.placed[1].job_id, "b");
  EXPECT_EQ(result.placed[2].job_id, "c");
  EXPECT_EQ(result.placed[0].ranks[0].gpu_index(), 0);
  EXPECT_EQ(result.placed[1].ranks[0].gpu_index(), 2);
  EXPECT_EQ(result.placed[2].ranks[0].gpu_index(), 4);
}

TEST(ScheduleTest, BackfillUsesCapacityOutsideTheHeadReservation) {
  // big needs all 8 GPUs of one node; on empty nodes that is a, which is half busy. b is not
  // reserved, so the small job may run there now.
  std::vector<GangRequest> requests = {Gang("big", 8, 8, 5, 1), Gang("small", 2, 1, 0, 2)};
  ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 8, 4), GpuNode("b", 4, 4)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(*Find(result, "small")), ElementsAre(Pair("b", 2)));
  EXPECT_THAT(result.pending_reasons,
              ElementsAre(Pair("big",
                               "tensor_parallel 8 needs 8 GPUs on one node, largest node "
                               "has 4 free")));
}

TEST(ScheduleTest, BackfillNeverTakesReservedGpus) {
  struct Case {
    std::string name;
    int big_priority;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"higher priority head", 5,
       "waiting behind higher-priority job big (backfill would delay it)"},
      {"older head of the same priority", 0,
       "waiting behind older job big (backfill would delay it)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    // The 4 free GPUs on a are part of big's reservation; small would fit there but must wait.
    std::vector<GangRequest> requests = {Gang("big", 8, 1, c.big_priority, 1),
                                         Gang("small", 2, 1, 0, 2)};
    ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 8, 4)});
    EXPECT_THAT(result.placed, IsEmpty());
    EXPECT_THAT(result.pending_reasons,
                UnorderedElementsAre(Pair("big", "needs 8 GPUs, largest free gang is 4"),
                                     Pair("small", c.reason)));
  }
}

TEST(ScheduleTest, BackfillMayUseFreeGpusBeyondTheReservationOnAReservedNode) {
  // On empty nodes big would fill a (the tie goes to the smaller id) and put one group of 4 on b,
  // so it reserves 4 of b's 8 GPUs. b has 6 free: 2 may be backfilled, 3 may not.
  std::vector<GangRequest> requests = {Gang("big", 12, 4, 1, 1), Gang("two", 2, 1, 0, 2),
                                       Gang("three", 3, 1, 0, 3)};
  std::vector<NodeCapacity> nodes = {GpuNode("a", 8, 0), GpuNode("b", 8, 6)};
  ScheduleResult result = CheckedSchedule(requests, nodes);
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(*Find(result, "two")), ElementsAre(Pair("b", 2)));
  EXPECT_EQ(result.pending_reasons["three"],
            "waiting behind higher-priority job big (backfill would delay it)");
}

TEST(ScheduleTest, OnlyTheFirstBlockedJobHoldsAReservation) {
  // head reserves a (the tighter of two empty 8-GPU nodes, by id). second is blocked too but
  // reserves nothing, so third may use b.
  std::vector<GangRequest> requests = {Gang("head", 8, 8, 0, 1), Gang("second", 8, 8, 0, 2),
                                       Gang("third", 2, 1, 0, 3)};
  ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 8, 4), GpuNode("b", 8, 6)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(*Find(result, "third")), ElementsAre(Pair("b", 2)));
  EXPECT_EQ(result.pending_reasons["second"],
            "tensor_parallel 8 needs 8 GPUs on one node, largest node has 6 free");
}

TEST(ScheduleTest, AJobThatCannotFitEvenOnEmptyNodesReservesNothing) {
  std::vector<GangRequest> requests = {Gang("huge", 32, 1, 9, 1), Gang("small", 4, 1, 0, 2)};
  ScheduleResult result = CheckedSchedule(requests, {GpuNode("a", 8, 4), GpuNode("b", 8, 8)});
  EXPECT_NE(Find(result, "small"), nullptr);
  EXPECT_EQ(result.pending_reasons["huge"],
            "needs 32 GPUs, schedulable nodes hold at most 16 even when empty");
}

// A small cluster driven through many passes: jobs run for a fixed number of passes, small jobs
// keep arriving, and the big head job must start as soon as the jobs that held its reserved
// GPUs end.
class Cluster {
 public:
  struct Running {
    std::string job_id;
    std::string node_id;
    int gpu = 0;
    int ends_at = 0;
  };

  explicit Cluster(std::vector<NodeCapacity> nodes) : nodes_(std::move(nodes)) {}

  void Hold(const std::string& job_id, const std::string& node_id, int gpus, int ends_at) {
    for (int gpu = 0; gpu < gpus; ++gpu) running_.push_back({job_id, node_id, gpu, ends_at});
  }

  // Ends what is due, schedules `pending`, starts the placed gangs for `duration` passes and
  // returns the result.
  ScheduleResult Pass(int pass, const std::vector<GangRequest>& pending, int duration) {
    std::erase_if(running_, [pass](const Running& r) { return r.ends_at <= pass; });
    std::vector<NodeCapacity> nodes = nodes_;
    for (NodeCapacity& node : nodes) {
      node.free_gpus.clear();
      for (int gpu = 0; gpu < node.total_gpus; ++gpu) {
        bool held = std::any_of(running_.begin(), running_.end(), [&](const Running& r) {
          return r.node_id == node.node_id && r.gpu == gpu;
        });
        if (!held) node.free_gpus.push_back(gpu);
      }
    }
    ScheduleResult result = CheckedSchedule(pending, nodes);
    for (const GangPlacement& placement : result.placed) {
      for (const v1::RankPlacement& rank : placement.ranks) {
        running_.push_back({placement.job_id, rank.node_id(), rank.gpu_index(), pass + duration});
      }
    }
    return result;
  }

 private:
  std::vector<NodeCapacity> nodes_;
  std::vector<Running> running_;
};

TEST(ScheduleTest, BackfillDoesNotStarveTheHeadJob) {
  // a and b (8 GPUs each) are busy until passes 3 and 6; c has 4 GPUs that the head's tp-8 groups
  // cannot use. Small jobs arrive every pass; without a reservation they would take a's GPUs at
  // pass 3 and keep the head waiting for as long as they keep coming.
  Cluster cluster({GpuNode("a", 8, 8), GpuNode("b", 8, 8), GpuNode("c", 4, 4)});
  cluster.Hold("init-a", "a", 8, 3);
  cluster.Hold("init-b", "b", 8, 6);
  cluster.Hold("init-c", "c", 4, 1);
  GangRequest head = Gang("head", 16, 8, 0, 0);
  std::vector<GangRequest> queue = {head};
  int next_small = 1;
  int head_started_at = -1;
  int smalls_backfilled = 0;
  for (int pass = 0; pass < 12 && head_started_at < 0; ++pass) {
    SCOPED_TRACE(absl::StrCat("pass ", pass));
    for (int i = 0; i < 2; ++i, ++next_small) {
      queue.push_back(Gang(absl::StrCat("small-", next_small), 2, 1, 0, next_small));
    }
    ScheduleResult result = cluster.Pass(pass, queue, /*duration=*/3);
    for (const GangPlacement& placement : result.placed) {
      if (placement.job_id == "head") {
        head_started_at = pass;
        EXPECT_THAT(RanksPerNode(placement), UnorderedElementsAre(Pair("a", 8), Pair("b", 8)));
        continue;
      }
      // While the head waits, small jobs run only on c, never on its reserved a and b.
      EXPECT_THAT(RanksPerNode(placement), ElementsAre(Pair("c", 2))) << placement.job_id;
      ++smalls_backfilled;
    }
    if (head_started_at < 0) {
      EXPECT_TRUE(result.pending_reasons.contains("head"));
    }
    std::erase_if(queue, [&](const GangRequest& r) { return Find(result, r.job_id) != nullptr; });
  }
  EXPECT_EQ(head_started_at, 6);
  EXPECT_GT(smalls_backfilled, 0);
}

TEST(ScheduleTest, GpuTypeAndNodeSelectorFilter) {
  NodeCapacity a100 = GpuNode("a100", 8, 8, kA100);
  NodeCapacity h100 = GpuNode("h100", 4, 4, kH100);
  h100.labels = {{"zone", "us-east"}, {"pool", "train"}};
  a100.labels = {{"zone", "us-west"}, {"pool", "train"}};
  const std::vector<NodeCapacity> nodes = {a100, h100};

  struct Case {
    std::string name;
    std::string gpu_type;
    std::map<std::string, std::string> selector;
    int world;
    std::string node;    // where it lands, or "" when pending
    std::string reason;  // when pending
  };
  const std::vector<Case> cases = {
      {"type picks the H100 node", "H100", {}, 2, "h100", ""},
      {"selector picks the west node", "", {{"zone", "us-west"}}, 2, "a100", ""},
      {"both labels must match", "", {{"zone", "us-east"}, {"pool", "train"}}, 2, "h100", ""},
      {"no such type", "B200", {}, 2, "", "needs 2 GPUs of type B200, none on a schedulable node"},
      {"no such label",
       "",
       {{"zone", "eu"}},
       2,
       "",
       "no schedulable node carries labels {zone=eu}"},
      {"type and selector disagree",
       "H100",
       {{"zone", "us-west"}},
       2,
       "",
       "needs 2 GPUs of type H100, none on a schedulable node with labels {zone=us-west}"},
      {"too many of the type",
       "H100",
       {},
       8,
       "",
       "needs 8 GPUs of type H100, schedulable nodes hold at most 4 even when empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    GangRequest request = Gang("job", c.world);
    request.gpu_type = c.gpu_type;
    request.node_selector = c.selector;
    ScheduleResult result = CheckedSchedule({request}, nodes);
    if (c.node.empty()) {
      EXPECT_THAT(result.placed, IsEmpty());
      EXPECT_THAT(result.pending_reasons, ElementsAre(Pair("job", c.reason)));
    } else {
      ASSERT_EQ(result.placed.size(), 1u);
      EXPECT_THAT(RanksPerNode(result.placed[0]), ElementsAre(Pair(c.node, c.world)));
    }
  }
}

TEST(ScheduleTest, UnschedulableNodesAreIgnored) {
  NodeCapacity draining = GpuNode("a", 2, 2);
  draining.schedulable = false;
  // a would be the tightest fit, but it is draining.
  ScheduleResult result = CheckedSchedule({Gang("job", 2)}, {draining, GpuNode("b", 8, 8)});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]), ElementsAre(Pair("b", 2)));

  result = CheckedSchedule({Gang("job", 2)}, {draining});
  EXPECT_THAT(result.placed, IsEmpty());
  EXPECT_THAT(result.pending_reasons,
              ElementsAre(Pair("job", "no schedulable node (all draining or lost)")));
}

TEST(ScheduleTest, CpuSlotGangs) {
  const std::vector<NodeCapacity> nodes = {CpuNode("cpu1", 4, 4), CpuNode("cpu2", 4, 2)};
  GangRequest two = Gang("two", 2);
  two.use_gpus = false;
  ScheduleResult result = CheckedSchedule({two}, nodes);
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]), ElementsAre(Pair("cpu2", 2)));
  EXPECT_EQ(result.placed[0].ranks[1].gpu_index(), -1);
  EXPECT_EQ(result.placed[0].ranks[1].local_rank(), 1);

  GangRequest six = Gang("six", 6);
  six.use_gpus = false;
  result = CheckedSchedule({six}, nodes);
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_THAT(RanksPerNode(result.placed[0]), ElementsAre(Pair("cpu1", 4), Pair("cpu2", 2)));
  EXPECT_EQ(result.placed[0].master_addr, "cpu1.cluster");

  GangRequest seven = Gang("seven", 7);
  seven.use_gpus = false;
  result = CheckedSchedule({seven}, nodes);
  EXPECT_EQ(result.pending_reasons["seven"], "needs 7 CPU slots, largest free gang is 6");
}

TEST(ScheduleTest, CpuAndGpuGangsDoNotCompete) {
  // A GPU node also offers CPU slots; a CPU head job reserves slots, not GPUs.
  GangRequest cpu_head = Gang("cpu-head", 4, 1, 9, 1);
  cpu_head.use_gpus = false;
  NodeCapacity a = GpuNode("a", 4, 4);
  a.free_cpu_slots = 2;
  std::vector<GangRequest> requests = {cpu_head, Gang("gpu", 4, 1, 0, 2)};
  ScheduleResult result = CheckedSchedule(requests, {a});
  ASSERT_EQ(result.placed.size(), 1u);
  EXPECT_EQ(result.placed[0].job_id, "gpu");
  EXPECT_EQ(result.pending_reasons["cpu-head"], "needs 4 CPU slots, largest free gang is 2");

  GangRequest cpu = Gang("cpu", 1);
  cpu.use_gpus = false;
  result = CheckedSchedule({cpu}, {CpuNode("c", 0, 0)});
  EXPECT_EQ(result.pending_reasons["cpu"], "needs 1 CPU slot, no CPU slots on a schedulable node");
  result = CheckedSchedule({Gang("gpu", 1)}, {CpuNode("c", 4, 4)});
  EXPECT_EQ(result.pending_reasons["gpu"], "needs 1 GPU, no GPUs on a schedulable node");
}

TEST(ScheduleTest, InvalidShapesArePendingWithAReason) {
  ScheduleResult result =
      CheckedSchedule({Gang("odd", 6, 4), Gang("zero", 0), Gang("ok", 2)}, {GpuNode("a", 8, 8)});
  EXPECT_NE(Find(result, "ok"), nullptr);
  EXPECT_EQ(result.pending_reasons["odd"], "tensor_parallel 4 does not divide world_size 6");
  EXPECT_EQ(result.pending_reasons["zero"], "world_size must be at least 1, got 0");
}

std::string Render(const ScheduleResult& result) {
  std::string text;
  for (const GangPlacement& placement : result.placed) {
    absl::StrAppend(&text, placement.job_id, "@", placement.master_addr, ":");
    for (const v1::RankPlacement& rank : placement.ranks) {
      absl::StrAppend(&text, " ", rank.ShortDebugString());
    }
    absl::StrAppend(&text, "\n");
  }
  for (const auto& [job_id, reason] : result.pending_reasons) {
    absl::StrAppend(&text, job_id, ": ", reason, "\n");
  }
  return text;
}

TEST(ScheduleTest, DeterministicWhateverTheInputOrder) {
  std::vector<NodeCapacity> nodes = {GpuNode("a", 8, 5), GpuNode("b", 8, 8), GpuNode("c", 4, 4),
                                     GpuNode("d", 8, 3)};
  std::vector<GangRequest> requests = {Gang("j1", 4, 2, 1, 1), Gang("j2", 8, 8, 1, 2),
                                       Gang("j3", 3, 1, 0, 3), Gang("j4", 16, 4, 2, 4),
                                       Gang("j5", 1, 1, 0, 5), Gang("j6", 2, 1, 0, 6)};
  const std::string first = Render(CheckedSchedule(requests, nodes));
  EXPECT_EQ(Render(CheckedSchedule(requests, nodes)), first);
  std::reverse(requests.begin(), requests.end());
  std::reverse(nodes.begin(), nodes.end());
  EXPECT_EQ(Render(CheckedSchedule(requests, nodes)), first);
  std::rotate(requests.begin(), requests.begin() + 2, requests.end());
  std::rotate(nodes.begin(), nodes.begin() + 1, nodes.end());
  EXPECT_EQ(Render(CheckedSchedule(requests, nodes)), first);
}

TEST(SchedulerUnsatisfiableTest, Messages) {
  NodeCapacity draining = GpuNode("c", 8, 0);
  draining.schedulable = false;
  NodeCapacity labelled = GpuNode("d", 4, 4, kA100);
  labelled.labels = {{"zone", "a"}};
  const std::vector<NodeCapacity> nodes = {GpuNode("a", 8, 0), GpuNode("b", 8, 8), draining,
                                           labelled};

  struct Case {
    std::string name;
    GangRequest request;
    std::optional<std::string> reason;
  };
  GangRequest h100 = Gang("j", 4);
  h100.gpu_type = "H100";
  GangRequest b200 = Gang("j", 4);
  b200.gpu_type = "B200";
  GangRequest h100_in_zone = h100;
  h100_in_zone.node_selector = {{"zone", "a"}};
  GangRequest a100_in_zone = h100_in_zone;
  a100_in_zone.gpu_type = "A100";
  GangRequest pool = Gang("j", 2);
  pool.node_selector = {{"pool", "train"}};
  GangRequest cpu = Gang("j", 12);
  cpu.use_gpus = false;
  GangRequest cpu_too_many = Gang("j", 17);
  cpu_too_many.use_gpus = false;
  const std::vector<Case> cases = {
      {"busy and draining nodes count as empty", Gang("j", 24, 8), std::nullopt},
      {"type present", h100, std::nullopt},
      {"type and selector", a100_in_zone, std::nullopt},
      {"cpu slots of GPU nodes", cpu, std::nullopt},
      {"too many GPUs", Gang("j", 29), "needs 29 GPUs, matching nodes hold at most 28"},
      {"tp larger than any node", Gang("j", 16, 16),
       "tensor_parallel 16 needs 16 GPUs on one node, largest node has 8"},
      {"seven groups of 4 on 8+8+8+4", Gang("j", 28, 4), std::nullopt},
      {"groups of 8 leave node d out", Gang("j", 32, 8),
       "needs 32 GPUs in tensor_parallel groups of 8, matching nodes hold at most 24"},
      {"no such type", b200, "needs 4 GPUs of type B200, none registered"},
      {"type not under the selector", h100_in_zone,
       "needs 4 GPUs of type H100, none registered with labels {zone=a}"},
      {"no such label", pool, "no node carries labels {pool=train}"},
      {"too many cpu slots", cpu_too_many, "needs 17 CPU slots, matching nodes hold at most 16"},
      {"bad shape", Gang("j", 6, 4), "tensor_parallel 4 does not divide world_size 6"},
      {"negative tp", Gang("j", 6, -1), "tensor_parallel must be at least 1, got -1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(Unsatisfiable(c.request, nodes), c.reason);
  }
  EXPECT_EQ(Unsatisfiable(Gang("j", 1), {}), "no node registered");
}

// Topology: nodes a0, a1 in rack ra (8 GPUs each, a0 half free), b0, b1 in rack rb (all free).
std::vector<NodeCapacity> TwoRacks() {
  std::vector<NodeCapacity> nodes = {GpuNode("a0", 8, 4), GpuNode("a1", 8, 8), GpuNode("b0", 8, 8),
                                     GpuNode("b1", 8, 8)};
  for (NodeCapacity& node : nodes) node.topology["rack"] = std::string("r") + node.node_id[0];
  return nodes;
}

GangRequest InOneRack(const std::string& id, int world, bool required) {
  GangRequest request = Gang(id, world);
  request.placement_level = "rack";
  request.placement_required = required;
  return request;
}

// A gang kept inside one rack goes to the fullest rack that holds it (best fit), so the empty
// rack stays whole for a gang that needs all of it.
TEST(ScheduleTopologyTest, ARequiredLevelPacksInsideTheFullestDomainThatHoldsTheGang) {
  const std::vector<NodeCapacity> nodes = TwoRacks();
  const std::vector<GangRequest> requests = {InOneRack("small", 12, true),
                                             InOneRack("whole", 16, true)};
  ScheduleResult result = Schedule(requests, nodes);
  ExpectValidPass(result, requests, nodes);
  ASSERT_NE(Find(result, "small"), nullptr) << result.pending_reasons["small"];
  EXPECT_THAT(RanksPerNode(*Find(result, "small")), ElementsAre(Pair("a0", 4), Pair("a1", 8)));
  ASSERT_NE(Find(result, "whole"), nullptr) << result.pending_reasons["whole"];
  EXPECT_THAT(RanksPerNode(*Find(result, "whole")), ElementsAre(Pair("b0", 8), Pair("b1", 8)));

  // Without a level a gang of 20 spans the racks: three nodes, by the packing rule.
  result = Schedule({Gang("anywhere", 20)}, nodes);
  ASSERT_NE(Find(result, "anywhere"), nullptr);
  EXPECT_EQ(RanksPerNode(*Find(result, "anywhere")).size(), 3u);
}

// No rack has room: a required gang waits naming the level and the largest free rack, and as the
// head reserves one rack's slots; a preferred one takes nodes of both racks instead.
TEST(ScheduleTopologyTest, RequiredWaitsNamingTheLargestFreeDomainAndPreferredSpreads) {
  std::vector<NodeCapacity> nodes = TwoRacks();
  nodes[2].free_gpus.resize(4);  // b0: 4 of 8 free
  ScheduleResult result = Schedule({InOneRack("needs-16", 16, true)}, nodes);
  EXPECT_TRUE(result.placed.empty());
  EXPECT_EQ(result.pending_reasons["needs-16"],
            "needs 16 GPUs inside one rack (placement.required); the largest free rack, ra, "
            "offers 12");

  // As the head it reserves rack ra (the fullest that holds it when empty: ties go to the
  // smaller name), so a later small gang backfills only onto rack rb.
  result = Schedule({InOneRack("needs-16", 16, true), Gang("small", 4, 1, 0, 1)}, nodes);
  ASSERT_NE(Find(result, "small"), nullptr) << result.pending_reasons["small"];
  for (const v1::RankPlacement& rank : Find(result, "small")->ranks) {
    EXPECT_EQ(rank.node_id()[0], 'b') << rank.node_id();
  }

  result = Schedule({InOneRack("prefers", 16, false)}, nodes);
  ASSERT_NE(Find(result, "prefers"), nullptr) << result.pending_reasons["prefers"];
  std::set<char> racks;
  for (const v1::RankPlacement& rank : Find(result, "prefers")->ranks) {
    racks.insert(rank.node_id()[0]);
  }
  EXPECT_EQ(racks.size(), 2u);

  // A node naming no rack is a rack of its own.
  nodes = {GpuNode("x", 8, 8), GpuNode("y", 8, 8)};
  result = Schedule({InOneRack("two-nodes", 16, true)}, nodes);
  EXPECT_TRUE(result.placed.empty());
  EXPECT_EQ(result.pending_reasons["two-nodes"],
            "needs 16 GPUs inside one rack (placement.required); the largest rack, node x, "
            "holds 8 even when empty");
  EXPECT_EQ(Unsatisfiable(InOneRack("two-nodes", 16, true), nodes),
            "needs 16 GPUs inside one rack (placement.required); the largest matching rack, "
            "node x, holds 8");
  EXPECT_EQ(Unsatisfiable(InOneRack("two-nodes", 16, true), TwoRacks()), std::nullopt);
}

// A gang over several racks numbers its nodes rack by rack (topology_path, highest level
// first), so consecutive ranks share a rack wherever the nodes allow; without paths the packing
// order stands.
TEST(ScheduleTopologyTest, RanksAreNumberedDomainByDomain) {
  std::vector<NodeCapacity> nodes = {GpuNode("n1", 8, 8), GpuNode("n2", 8, 8), GpuNode("n3", 8, 8),
                                     GpuNode("n4", 8, 8)};
  auto node_order = [](const GangPlacement& placement) {
    std::vector<std::string> order;
    for (const v1::RankPlacement& rank : placement.ranks) {
      if (order.empty() || order.back() != rank.node_id()) order.push_back(rank.node_id());
    }
    return order;
  };
  ScheduleResult result = Schedule({Gang("j", 32)}, nodes);
  ASSERT_NE(Find(result, "j"), nullptr);
  EXPECT_THAT(node_order(*Find(result, "j")), ElementsAre("n1", "n2", "n3", "n4"));

  // Blocks b1 (racks r1 and r2) and b2 (rack r3): n1 r2, n2 r3, n3 r1, n4 r2.
  const std::vector<std::vector<std::string>> paths = {
      {"b1", "r2"}, {"b2", "r3"}, {"b1", "r1"}, {"b1", "r2"}};
  for (size_t i = 0; i < nodes.size(); ++i) nodes[i].topology_path = paths[i];
  const std::vector<GangRequest> requests = {Gang("j", 32)};
  result = Schedule(requests, nodes);
  ExpectValidPass(result, requests, nodes);
  ASSERT_NE(Find(result, "j"), nullptr);
  EXPECT_THAT(node_order(*Find(result, "j")), ElementsAre("n3", "n1", "n4", "n2"));
  EXPECT_EQ(Find(result, "j")->master_addr, "n3.cluster");
}

}  // namespace
}  // namespace tessera::coordinator
