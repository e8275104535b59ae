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
  std::array<int, kMeshDims> coords{};
  // Sum of the global ranks in this rank's group along each dimension (its own rank alone when
  // the dimension has size 1).
  std::array<int64_t, kMeshDims> sums{};
  bool world_group_reused = false;
};

std::vector<RankResult> RunMesh(const MeshShape& shape) {
  std::vector<RankResult> results(shape.world());
  testing::RunMeshThreads(shape, [&](int rank, const JoinedGroup& world, const DeviceMesh& mesh) {
    RankResult& result = results[rank];
    for (int d = 0; d < kMeshDims; ++d) {
      const MeshDim dim = static_cast<MeshDim>(d);
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
    EXPECT_EQ(results[rank].coords, (std::array<int, 3>{pp, dp, tp}));
    EXPECT_EQ(DeviceMesh::RankAt(shape, {pp, dp, tp}), rank);
    // tp: consecutive ranks {2k, 2k+1}; dp: {r, r ^ 2}; pp: {r, r ^ 4}.
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kTensor)], 2 * (rank / 2 * 2) + 1);
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kData)], rank + (rank ^ 2));
    EXPECT_EQ(results[rank].sums[static_cast<int>(MeshDim::kPipeline)], rank + (rank ^ 4));
    EXPECT_FALSE(results[rank].world_group_reused);
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
