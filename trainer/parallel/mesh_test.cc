// DeviceMesh on real Gloo groups: ranks simulated by threads sharing a HashStore (c10d's own
// way). Each rank all-reduces its rank number along every dimension; the sums tell which ranks
// each group holds.
#include "trainer/parallel/mesh.h"

#include <array>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/parallel/mesh_threads.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

struct RankResult {
  std::array<int, kMeshGroups> coords{};
  // Sum of the global ranks in this rank's group along each dimension (its own rank alone when
  // the dimension has size 1).
  std::array<int64_t, kMeshGroups> sums{};
  // Whether each group is the same object as another of this rank's groups.
  std::array<bool, kMeshGroups> shared{};
  bool world_group_reused = false;
};

std::vector<RankResult> RunMesh(const MeshShape& shape) {
  std::vector<RankResult> results(shape.world());
  testing::RunMeshThreads(shape, [&](int rank, const JoinedGroup& world, const DeviceMesh& mesh) {
    RankResult& result = results[rank];
    for (int d = 0; d < kMeshGroups; ++d) {
      const MeshDim dim = static_cast<MeshDim>(d);
      for (int other = 0; other < d; ++other) {
        if (mesh.group(dim) && mesh.group(dim).get() == mesh.group(static_cast<MeshDim>(other)).get()) {
          result.shared[d] = true;
        }
      }
      result.coords[d] = mesh.coord(dim);
      if (mesh.size(dim) == 1) {
        EXPECT_FALSE(mesh.group(dim)) << MeshDimName(dim);
        result.sums[d] = rank;
        continue;
      }
      ASSERT_TRUE(mesh.group(dim)) << MeshDimName(dim);
      EXPECT_EQ(mesh.group(dim)->getSize(), mesh.size(dim));
      result.world_group_reused |= mesh.group(dim).get() == world.group.get();
      std::vector<at::Tensor> tensors{at::full({1}, rank, at::kLong)};
      mesh.group(dim)->allreduce(tensors)->wait();
      result.sums[d] = tensors[0].item<int64_t>();
    }
  });
  return results;
}

TEST(DeviceMeshTest, GroupsHoldTheRanksThatDifferAlongTheirDimensionOnly) {
  // pp 2 x dp 2 x tp 2: rank = (pp * 2 + dp) * 2 + tp.
  const MeshShape shape{.pp = 2, .dp = 2, .tp = 2};
  const std::vector<RankResult> results = RunMesh(shape);
  for (int rank = 0; rank < shape.world(); ++rank) {
    SCOPED_TRACE(rank);
    const int pp = rank / 4, dp = (rank / 2) % 2, tp = rank % 2;
    EXPECT_EQ(results[rank].coords[0], pp);
    EXPECT_EQ(results[rank].coords[1], dp);
    EXPECT_EQ(results[rank].coords[2], 0);
    EXPECT_EQ(results[rank].coords[3], tp);
    EXPECT_EQ(DeviceMesh::RankAt(shape, {.pp = pp, .dp = dp, .tp = tp}), rank);
    // tp: consecutive ranks {2k, 2k+1}; dp: {r, r ^ 2}; pp: {r, r ^ 4}.
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kTensor)], 2 * (rank / 2 * 2) + 1);
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kData)], rank + (rank ^ 2));
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kPipeline)], rank + (rank ^ 4));
    EXPECT_FALSE(results[rank].world_group_reused);
  }
}

TEST(DeviceMeshTest, ContextAndExpertGroupsFollowTheirDefinitions) {
  // dp 4 x cp 2, ep 2: rank = dp * 2 + cp.
  const MeshShape shape{.dp = 4, .cp = 2, .ep = 2};
  const std::vector<RankResult> results = RunMesh(shape);
  const auto at = [](MeshDim dim) { return static_cast<int>(dim); };
  for (int rank = 0; rank < shape.world(); ++rank) {
    SCOPED_TRACE(rank);
    const int dp = rank / 2, cp = rank % 2;
    const RankResult& r = results[rank];
    EXPECT_EQ(r.coords[at(MeshDim::kData)], dp);
    EXPECT_EQ(r.coords[at(MeshDim::kContext)], cp);
    EXPECT_EQ(DeviceMesh::RankAt(shape, {.dp = dp, .cp = cp}), rank);
    EXPECT_EQ(DeviceMesh::CoordsOf(shape, rank).cp, cp);
    // cp: {2k, 2k+1}; dp: the 4 ranks with the same cp.
    EXPECT_EQ(r.sums[at(MeshDim::kContext)], 4 * dp + 1);
    EXPECT_EQ(r.sums[at(MeshDim::kData)], cp * 4 + (0 + 2 + 4 + 6));
    // ep: dp blocks {0,1} and {2,3}; edp: dp coordinates of equal parity.
    const int block = dp / 2 * 2;
    EXPECT_EQ(r.coords[at(MeshDim::kExpert)], dp % 2);
    EXPECT_EQ(r.sums[at(MeshDim::kExpert)], (block * 2 + cp) + ((block + 1) * 2 + cp));
    EXPECT_EQ(r.coords[at(MeshDim::kExpertData)], dp / 2);
    EXPECT_EQ(r.sums[at(MeshDim::kExpertData)], ((dp % 2) * 2 + cp) + ((dp % 2 + 2) * 2 + cp));
    // dcp spans the world here, and reuses the world group.
    EXPECT_EQ(r.coords[at(MeshDim::kDataContext)], rank);
    EXPECT_EQ(r.sums[at(MeshDim::kDataContext)], 28);
    EXPECT_TRUE(r.world_group_reused);
  }
}

TEST(DeviceMeshTest, DerivedGroupsEqualToABaseGroupShareIt) {
  // No ep and no cp: edp and dcp are the dp group itself.
  const std::vector<RankResult> results = RunMesh(MeshShape{.dp = 2, .tp = 2});
  for (const RankResult& r : results) {
    EXPECT_TRUE(r.shared[static_cast<int>(MeshDim::kExpertData)]);
    EXPECT_TRUE(r.shared[static_cast<int>(MeshDim::kDataContext)]);
    EXPECT_EQ(r.sums[static_cast<int>(MeshDim::kExpertData)],
              r.sums[static_cast<int>(MeshDim::kData)]);
  }
}

TEST(DeviceMeshTest, ADimensionSpanningTheWorldReusesTheWorldGroup) {
  const MeshShape shape{.pp = 1, .dp = 3, .tp = 1};
  const std::vector<RankResult> results = RunMesh(shape);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(results[rank].coords[static_cast<int>(MeshDim::kData)], rank);
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kData)], 0 + 1 + 2);
    EXPECT_TRUE(results[rank].world_group_reused);
  }
}

TEST(DeviceMeshTest, ShapeForLayoutFillsDataParallelAndNamesTheFieldAtFault) {
  v1::Layout layout;
  layout.set_tensor_parallel(2);
  auto shape = MeshShapeForLayout(layout, 8);
  ASSERT_THAT(shape, IsOk());
  EXPECT_EQ(shape->dp, 4);
  EXPECT_EQ(shape->tp, 2);
  EXPECT_EQ(shape->pp, 1);
  layout.set_data_parallel(3);
  EXPECT_THAT(MeshShapeForLayout(layout, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.data_parallel 3")));
  layout.set_data_parallel(0);
  layout.set_pipeline_parallel(3);
  EXPECT_THAT(MeshShapeForLayout(layout, 8),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not divide")));
  layout.set_pipeline_parallel(1);
  layout.set_context_parallel(2);
  layout.set_expert_parallel(2);
  shape = MeshShapeForLayout(layout, 8);
  ASSERT_THAT(shape, IsOk());
  EXPECT_EQ(shape->dp, 2);
  EXPECT_EQ(shape->cp, 2);
  EXPECT_EQ(shape->ep, 2);
  layout.set_expert_parallel(4);
  EXPECT_THAT(MeshShapeForLayout(layout, 8),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("parallelism.layout.expert_parallel 4 does not divide")));
}

TEST(DeviceMeshTest, OneRankNeedsNoGroups) {
  auto mesh = DeviceMesh::Create(MeshShape{}, 0, nullptr, ProcessGroupOptions{});
  ASSERT_THAT(mesh, IsOk());
  EXPECT_FALSE(mesh->group(MeshDim::kData));
  EXPECT_THAT(DeviceMesh::Create(MeshShape{.dp = 2}, 0, nullptr, ProcessGroupOptions{}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(DeviceMesh::Create(MeshShape{.dp = 2}, 2, nullptr, ProcessGroupOptions{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the mesh")));
}

}  // namespace
}  // namespace tessera::trainer
