#include "trainer/parallel/mesh.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace tessera::trainer {

const char* MeshDimName(MeshDim dim) {
  switch (dim) {
    case MeshDim::kPipeline:
      return "pp";
    case MeshDim::kData:
      return "dp";
    case MeshDim::kTensor:
      return "tp";
  }
  return "?";
}

int MeshShape::size(MeshDim dim) const {
  switch (dim) {
    case MeshDim::kPipeline:
      return pp;
    case MeshDim::kData:
      return dp;
    case MeshDim::kTensor:
      return tp;
  }
  return 1;
}

absl::StatusOr<MeshShape> MeshShapeForLayout(const v1::Layout& layout, int world_size) {
  MeshShape shape;
  shape.tp = std::max(1, layout.tensor_parallel());
  shape.pp = std::max(1, layout.pipeline_parallel());
  if (layout.tensor_parallel() < 0 || layout.pipeline_parallel() < 0 ||
      layout.data_parallel() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallelism.layout: degrees must be >= 0, got dp ", layout.data_parallel(),
                     ", tp ", layout.tensor_parallel(), ", pp ", layout.pipeline_parallel()));
  }
  if (world_size % (shape.tp * shape.pp) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.layout: tensor_parallel ", shape.tp,
                                                   " x pipeline_parallel ", shape.pp,
                                                   " does not divide the world size ", world_size));
  }
  shape.dp =
      layout.data_parallel() > 0 ? layout.data_parallel() : world_size / (shape.tp * shape.pp);
  if (shape.world() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallelism.layout.data_parallel ", shape.dp, " x tensor_parallel ", shape.tp,
        " x pipeline_parallel ", shape.pp, " = ", shape.world(), " != world size ", world_size));
  }
  return shape;
}

int DeviceMesh::RankAt(const MeshShape& shape, const std::array<int, kMeshDims>& coords) {
  return (coords[0] * shape.dp + coords[1]) * shape.tp + coords[2];
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(const MeshShape& shape, int rank,
                                              const JoinedGroup* world,
                                              const ProcessGroupOptions& options) {
  if (rank < 0 || rank >= shape.world()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the mesh of ", shape.world(), " ranks"));
  }
  if (shape.world() > 1 && world == nullptr) {
    return absl::FailedPreconditionError("a mesh of several ranks needs the world group");
  }
  DeviceMesh mesh;
  mesh.shape_ = shape;
  mesh.rank_ = rank;
  mesh.coords_ = {rank / (shape.dp * shape.tp), (rank / shape.tp) % shape.dp, rank % shape.tp};
  const v1::DeviceType device_type =
      world != nullptr && world->backend == "nccl" ? v1::DEVICE_TYPE_CUDA : v1::DEVICE_TYPE_CPU;
  for (int d = 0; d < kMeshDims; ++d) {
    const int size = shape.size(static_cast<MeshDim>(d));
    if (size == 1) continue;
    if (size == shape.world()) {
      mesh.groups_[d] = world->group;
      continue;
    }
    // The line through this rank along d: the other coordinates fixed. Its first member's rank
    // names the line, so that every member builds the same store prefix.
    std::array<int, kMeshDims> first = mesh.coords_;
    first[d] = 0;
    const std::string prefix =
        absl::StrCat("mesh/", MeshDimName(static_cast<MeshDim>(d)), "/", RankAt(shape, first), "/");
    try {
      auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, world->store);
      ASSIGN_OR_RETURN(mesh.groups_[d], NewProcessGroup(store, mesh.coords_[d], size, device_type,
                                                        world->hostname, options));
    } catch (const c10::Error& e) {
      return absl::UnavailableError(
          absl::StrCat("mesh group ", prefix, ": ", e.what_without_backtrace()));
    }
  }
  return mesh;
}

std::string DeviceMesh::Describe() const {
  std::vector<std::string> parts;
  for (MeshDim dim : {MeshDim::kData, MeshDim::kTensor, MeshDim::kPipeline}) {
    parts.push_back(absl::StrCat(MeshDimName(dim), " ", coord(dim), "/", size(dim)));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace tessera::trainer
