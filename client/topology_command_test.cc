// `tessera nodes --topology` prints the domains as a tree (highest level first, a node without a
// label where it belongs) and each level's figures.
#include "client/topology_command.h"

#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

TEST(TopologyCommandTest, ATreeOfDomainsThenTheFiguresPerLevel) {
  v1::ListNodesResponse response;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        nodes {
          node_id: "a1"
          resources { gpus { index: 0 } }
        }
        topology_levels {
          name: "rack"
          domains: 3
          whole_free_domains: 1
          largest_free: 16
          free: 22
          fragmentation: 0.2727
        }
        topology_levels {
          name: "block"
          domains: 2
          whole_free_domains: 0
          largest_free: 18
          free: 22
          fragmentation: 1
        }
        topology_domains {
          level: 0
          domain: "r1"
          parent: "b1"
          free: 16
          total: 16
          node_ids: "a1"
          node_ids: "a2"
        }
        topology_domains { level: 0 domain: "r2" parent: "b1" free: 2 total: 8 node_ids: "b1" }
        topology_domains {
          level: 0
          domain: "solo"
          parent: "solo"
          node_only: true
          free: 4
          total: 8
          node_ids: "solo"
        }
        topology_domains {
          level: 1
          domain: "b1"
          free: 18
          total: 24
          node_ids: "a1"
          node_ids: "a2"
          node_ids: "b1"
        }
        topology_domains {
          level: 1
          domain: "solo"
          node_only: true
          free: 4
          total: 8
          node_ids: "solo"
        }
      )pb",
      &response));
  const std::string tree = TopologyTree(response);
  EXPECT_EQ(tree,
            "topology, GPUs of ready nodes:\n"
            "  block b1                                       18/24     free\n"
            "    rack r1                                      16/16     free\n"
            "      a1\n"
            "      a2\n"
            "    rack r2                                       2/8      free\n"
            "      b1\n"
            "  node solo (no block label)                      4/8      free\n"
            "    node solo (no rack label)                     4/8      free\n"
            "\n"
            "level             domains  whole free  largest free     free  fragmentation\n"
            "rack                    3           1            16       22           0.27\n"
            "block                   2           0            18       22           1.00\n");
  EXPECT_THAT(TopologyTree(v1::ListNodesResponse()), ::testing::HasSubstr("--topology_levels"));
}

}  // namespace
}  // namespace tessera::client
