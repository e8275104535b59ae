// The cluster's shape: levels parsed with errors that name what is wrong, domains kept
// consistently nested as nodes come and go, and the tree and per-level figures of a small cluster.
#include "coordinator/scheduler/topology.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::HasSubstr;

TEST(TopologyTest, LevelsParseOrNameTheirError) {
  auto levels = ParseTopologyLevels("nvlink-domain:900, rack:200,block,zone:12.5");
  ASSERT_TRUE(levels.ok()) << levels.status();
  ASSERT_EQ(levels->size(), 4u);
  EXPECT_EQ((*levels)[0].name, "nvlink-domain");
  EXPECT_EQ((*levels)[0].bandwidth_gbps, 900);
  EXPECT_EQ((*levels)[2].name, "block");
  EXPECT_EQ((*levels)[2].bandwidth_gbps, 0);
  EXPECT_EQ((*levels)[3].bandwidth_gbps, 12.5);
  EXPECT_TRUE(ParseTopologyLevels("").ok());
  EXPECT_THAT(ParseTopologyLevels("rack,rack").status().message(), HasSubstr("given twice"));
  EXPECT_THAT(ParseTopologyLevels("Rack").status().message(), HasSubstr("lowercase"));
  EXPECT_THAT(ParseTopologyLevels("rack:fast").status().message(), HasSubstr("'fast'"));
  EXPECT_THAT(ParseTopologyLevels("rack:-1").status().message(), HasSubstr("GB/s > 0"));
}

TEST(TopologyTest, TheIndexKeepsDomainsNestedOneWay) {
  TopologyIndex index(*ParseTopologyLevels("rack,block,zone"));
  const std::map<std::string, std::string> n1 = {{"rack", "r1"}, {"block", "b1"}};
  ASSERT_TRUE(index.Check("n1", n1).ok());
  index.Add("n1", n1);
  // Another node of rack r1 in another block: refused, naming both sides.
  absl::Status status = index.Check("n2", {{"rack", "r1"}, {"block", "b2"}});
  EXPECT_TRUE(absl::IsInvalidArgument(status));
  EXPECT_EQ(status.message(),
            "node n2: topology rack=r1 is in block=b1 (node n1 says so), not block=b2");
  // The same block, or no block named: fine. A zone for b1 is new knowledge.
  EXPECT_TRUE(index.Check("n2", {{"rack", "r1"}, {"block", "b1"}, {"zone", "z1"}}).ok());
  EXPECT_TRUE(index.Check("n3", {{"rack", "r1"}}).ok());
  EXPECT_THAT(
      index.Check("n4", {{"row", "x"}}).message(),
      HasSubstr("node n4: topology row=x: unknown level row (levels: rack < block < zone)"));
  EXPECT_THAT(TopologyIndex().Check("n5", {{"rack", "r1"}}).message(),
              HasSubstr("no --topology_levels"));
  // Once n1 is gone, nothing says where r1 is.
  index.Remove("n1", n1);
  EXPECT_TRUE(index.Check("n2", {{"rack", "r1"}, {"block", "b2"}}).ok());
}

TEST(TopologyTest, TheTreeAndItsFiguresPerLevel) {
  const std::vector<TopologyLevel> levels = *ParseTopologyLevels("rack,block");
  const std::vector<TopologyNode> nodes = {
      {.node_id = "a1", .labels = {{"rack", "r1"}, {"block", "b1"}}, .free = 8, .total = 8},
      {.node_id = "a2", .labels = {{"rack", "r1"}, {"block", "b1"}}, .free = 8, .total = 8},
      {.node_id = "b1", .labels = {{"rack", "r2"}, {"block", "b1"}}, .free = 2, .total = 8},
      {.node_id = "c1", .labels = {{"rack", "r3"}, {"block", "b2"}}, .free = 8, .total = 8},
      // No labels: a domain of its own at every level.
      {.node_id = "solo", .free = 4, .total = 8},
      // Drained or lost: its devices count as neither free nor total.
      {.node_id = "gone",
       .labels = {{"rack", "r3"}, {"block", "b2"}},
       .free = 8,
       .total = 8,
       .schedulable = false},
  };
  const TopologyView view = BuildTopology(levels, nodes);
  ASSERT_EQ(view.levels.size(), 2u);
  const TopologyLevelFigures& racks = view.levels[0];
  EXPECT_EQ(racks.level, "rack");
  EXPECT_EQ(racks.domains, 4);             // r1, r2, r3, solo
  EXPECT_EQ(racks.whole_free_domains, 2);  // r1 (16 of 16), r3 (8 of 8)
  EXPECT_EQ(racks.largest_free, 16);
  EXPECT_EQ(racks.free, 30);
  EXPECT_DOUBLE_EQ(racks.fragmentation, 6.0 / 30);  // r2's 2 and solo's 4
  const TopologyLevelFigures& blocks = view.levels[1];
  EXPECT_EQ(blocks.domains, 3);  // b1, b2, solo
  EXPECT_EQ(blocks.whole_free_domains, 1);
  EXPECT_EQ(blocks.largest_free, 18);
  EXPECT_DOUBLE_EQ(blocks.fragmentation, 22.0 / 30);

  // Racks under their block, by (parent, domain); a node-only domain says so.
  std::vector<std::string> rack_rows;
  for (const TopologyDomain& d : view.domains) {
    if (d.level != 0) continue;
    rack_rows.push_back(d.parent + "/" + d.domain + (d.node_only ? " (node)" : "") + " " +
                        std::to_string(d.free) + "/" + std::to_string(d.total));
  }
  EXPECT_THAT(rack_rows, ::testing::ElementsAre("b1/r1 16/16", "b1/r2 2/8", "b2/r3 8/8",
                                                "solo/solo (node) 4/8"));
  EXPECT_TRUE(BuildTopology({}, nodes).levels.empty());
}

TEST(TopologyTest, APlacementNamesOneOfTheClustersLevels) {
  const std::vector<TopologyLevel> levels = {{"rack", 200}, {"block", 50}};
  EXPECT_TRUE(CheckPlacementLevels("", "", levels).ok());
  EXPECT_TRUE(CheckPlacementLevels("rack", "", levels).ok());
  EXPECT_TRUE(CheckPlacementLevels("", "block", levels).ok());
  absl::Status refused = CheckPlacementLevels("row", "", levels);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("placement.required: 'row' is not a topology level of "
                                           "this cluster (its levels: rack, block;"));
  refused = CheckPlacementLevels("", "rack", {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("placement.preferred: 'rack' is not a topology level of "
                                           "this cluster (it has none;"));
  // Not a level name at all: the spec's validation says so (INVALID_ARGUMENT).
  EXPECT_TRUE(CheckPlacementLevels("Rack 1", "", levels).ok());
}

}  // namespace
}  // namespace tessera::coordinator
