// The Store's worker nodes (store_nodes.cc): upsert, list, delete.
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <memory>
#include <vector>

#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::SizeIs;

TEST(StoreTest, NodesUpsertListDelete) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  v1::Node node_b;
  node_b.set_node_id("node-b");
  node_b.set_state(v1::NODE_STATE_READY);
  v1::Node node_a;
  node_a.set_node_id("node-a");
  node_a.set_address("10.0.0.1:50052");
  ASSERT_THAT(store->PutNode(node_b), IsOk());
  ASSERT_THAT(store->PutNode(node_a), IsOk());
  node_b.set_state(v1::NODE_STATE_LOST);
  ASSERT_THAT(store->PutNode(node_b), IsOk());
  EXPECT_THAT(store->PutNode(v1::Node()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node_id")));

  absl::StatusOr<std::vector<v1::Node>> nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  ASSERT_THAT(*nodes, SizeIs(2));
  EXPECT_EQ((*nodes)[0].node_id(), "node-a");
  EXPECT_EQ((*nodes)[0].address(), "10.0.0.1:50052");
  EXPECT_EQ((*nodes)[1].node_id(), "node-b");
  EXPECT_EQ((*nodes)[1].state(), v1::NODE_STATE_LOST);

  ASSERT_THAT(store->DeleteNode("node-a"), IsOk());
  ASSERT_THAT(store->DeleteNode("node-absent"), IsOk());
  nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  ASSERT_THAT(*nodes, SizeIs(1));
  EXPECT_EQ((*nodes)[0].node_id(), "node-b");
}

}  // namespace
}  // namespace tessera::coordinator
