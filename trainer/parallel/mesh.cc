#include "trainer/parallel/mesh.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "trainer/parallel/collective_timer.h"

namespace tessera::trainer {

const char* MeshDimName(MeshDim dim) {
  switch (dim) {
    case MeshDim::kPipeline:
      return "pp";
    case MeshDim::kData:
      return "dp";
    case MeshDim::kContext:
      return "cp";
    case MeshDim::kTensor:
      return "tp";
    case MeshDim::kExpert:
      return "ep";
    case MeshDim::kExpertData:
      return "edp";
    case MeshDim::kDataContext:
      return "dcp";
  }
  return "?";
}

int MeshShape::size(MeshDim dim) const {
  switch (dim) {
    case MeshDim::kPipeline:
      return pp;
    case MeshDim::kData:
      return dp;
    case MeshDim::kContext:
      return cp;
    case MeshDim::kTensor:
      return tp;
    case MeshDim::kExpert:
      return ep;
    case MeshDim::kExpertData:
      return dp / ep;
    case MeshDim::kDataContext:
      return dp * cp;
  }
  return 1;
}

absl::StatusOr<MeshShape> MeshShapeForLayout(const v1::Layout& layout, int world_size) {
  if (layout.tensor_parallel() < 0 || layout.pipeline_parallel() < 0 ||
      layout.data_parallel() < 0 || layout.context_parallel() < 0 ||
      layout.expert_parallel() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallelism.layout: degrees must be >= 0, got dp ", layout.data_parallel(), ", tp ",
        layout.tensor_parallel(), ", pp ", layout.pipeline_parallel(), ", cp ",
        layout.context_parallel(), ", ep ", layout.expert_parallel()));
  }
  MeshShape shape;
  shape.tp = std::max(1, layout.tensor_parallel());
  shape.pp = std::max(1, layout.pipeline_parallel());
  shape.cp = std::max(1, layout.context_parallel());
  shape.ep = std::max(1, layout.expert_parallel());
  const int model_ranks = shape.tp * shape.pp * shape.cp;
  if (world_size % model_ranks != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallelism.layout: tensor_parallel ", shape.tp, " x pipeline_parallel ", shape.pp,
        " x context_parallel ", shape.cp, " does not divide the world size ", world_size));
  }
  shape.dp = layout.data_parallel() > 0 ? layout.data_parallel() : world_size / model_ranks;
  if (shape.world() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parallelism.layout.data_parallel ", shape.dp, " x tensor_parallel ", shape.tp,
        " x pipeline_parallel ", shape.pp, " x context_parallel ", shape.cp, " = ",
        shape.world(), " != world size ", world_size));
  }
  if (shape.dp % shape.ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat("parallelism.layout.expert_parallel ", shape.ep,
                                                   " does not divide data_parallel ", shape.dp,
                                                   " (experts are split inside the dp group)"));
  }
  return shape;
}

int DeviceMesh::RankAt(const MeshShape& shape, const MeshCoords& coords) {
  return ((coords.pp * shape.dp + coords.dp) * shape.cp + coords.cp) * shape.tp + coords.tp;
}

MeshCoords DeviceMesh::CoordsOf(const MeshShape& shape, int rank) {
  return MeshCoords{.pp = rank / (shape.dp * shape.cp * shape.tp),
                    .dp = (rank / (shape.cp * shape.tp)) % shape.dp,
                    .cp = (rank / shape.tp) % shape.cp,
                    .tp = rank % shape.tp};
}

int DeviceMesh::coord(MeshDim dim) const {
  switch (dim) {
    case MeshDim::kPipeline:
      return coords_.pp;
    case MeshDim::kData:
      return coords_.dp;
    case MeshDim::kContext:
      return coords_.cp;
    case MeshDim::kTensor:
      return coords_.tp;
    case MeshDim::kExpert:
      return coords_.dp % shape_.ep;
    case MeshDim::kExpertData:
      return coords_.dp / shape_.ep;
    case MeshDim::kDataContext:
      return coords_.dp * shape_.cp + coords_.cp;
  }
  return 0;
}

std::vector<int> DeviceMesh::GroupRanks(const MeshShape& shape, int rank, MeshDim dim) {
  const MeshCoords c = CoordsOf(shape, rank);
  std::vector<int> ranks;
  const auto at = [&](MeshCoords other) { ranks.push_back(RankAt(shape, other)); };
  switch (dim) {
    case MeshDim::kPipeline:
      for (int i = 0; i < shape.pp; ++i) at({.pp = i, .dp = c.dp, .cp = c.cp, .tp = c.tp});
      break;
    case MeshDim::kData:
      for (int i = 0; i < shape.dp; ++i) at({.pp = c.pp, .dp = i, .cp = c.cp, .tp = c.tp});
      break;
    case MeshDim::kContext:
      for (int i = 0; i < shape.cp; ++i) at({.pp = c.pp, .dp = c.dp, .cp = i, .tp = c.tp});
      break;
    case MeshDim::kTensor:
      for (int i = 0; i < shape.tp; ++i) at({.pp = c.pp, .dp = c.dp, .cp = c.cp, .tp = i});
      break;
    case MeshDim::kExpert: {
      const int block = c.dp / shape.ep * shape.ep;
      for (int i = 0; i < shape.ep; ++i) {
        at({.pp = c.pp, .dp = block + i, .cp = c.cp, .tp = c.tp});
      }
      break;
    }
    case MeshDim::kExpertData:
      for (int i = c.dp % shape.ep; i < shape.dp; i += shape.ep) {
        at({.pp = c.pp, .dp = i, .cp = c.cp, .tp = c.tp});
      }
      break;
    case MeshDim::kDataContext:
      for (int d = 0; d < shape.dp; ++d) {
        for (int i = 0; i < shape.cp; ++i) at({.pp = c.pp, .dp = d, .cp = i, .tp = c.tp});
      }
      break;
  }
  return ranks;
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(const MeshShape& shape, int rank,
                                              const JoinedGroup* world,
                                              const ProcessGroupOptions& options) {
  if (rank < 0 || rank >= shape.world()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the mesh of ", shape.world(), " ranks"));
  }
  if (shape.ep < 1 || shape.dp % shape.ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert parallelism ", shape.ep, " does not divide dp ", shape.dp));
  }
  if (shape.world() > 1 && world == nullptr) {
    return absl::FailedPreconditionError("a mesh of several ranks needs the world group");
  }
  DeviceMesh mesh;
  mesh.shape_ = shape;
  mesh.rank_ = rank;
  mesh.coords_ = CoordsOf(shape, rank);
  const v1::DeviceType device_type =
      world != nullptr && world->backend == "nccl" ? v1::DEVICE_TYPE_CUDA : v1::DEVICE_TYPE_CPU;
  for (int d = 0; d < kMeshGroups; ++d) {
    const MeshDim dim = static_cast<MeshDim>(d);
    const int size = shape.size(dim);
    if (size == 1) continue;
    if (size == shape.world()) {
      mesh.groups_[d] = world->group;
      continue;
    }
    // A derived group with the members of a base one shares its group.
    const auto same_as = [&](MeshDim base) {
      return shape.size(base) == size && mesh.groups_[static_cast<int>(base)];
    };
    if (dim == MeshDim::kExpertData && same_as(MeshDim::kData)) {
      mesh.groups_[d] = mesh.groups_[static_cast<int>(MeshDim::kData)];
      continue;
    }
    if (dim == MeshDim::kDataContext) {
      if (same_as(MeshDim::kData)) {
        mesh.groups_[d] = mesh.groups_[static_cast<int>(MeshDim::kData)];
        continue;
      }
      if (same_as(MeshDim::kContext)) {
        mesh.groups_[d] = mesh.groups_[static_cast<int>(MeshDim::kContext)];
        continue;
      }
    }
    // The group's first member names it, so that every member builds the same store prefix.
    const std::vector<int> members = GroupRanks(shape, rank, dim);
    const std::string prefix = absl::StrCat("mesh/", MeshDimName(dim), "/", members.front(), "/");
    try {
      auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, world->store);
      ASSIGN_OR_RETURN(mesh.groups_[d], NewProcessGroup(store, mesh.coord(dim), size, device_type,
                                                        world->hostname, options));
    } catch (const c10::Error& e) {
      return absl::UnavailableError(
          absl::StrCat("mesh group ", prefix, ": ", e.what_without_backtrace()));
    }
  }
  RegisterMeshCollectiveGroups(mesh, world != nullptr ? world->group.get() : nullptr);
  return mesh;
}

std::string DeviceMesh::Describe() const {
  std::vector<std::string> parts;
  for (MeshDim dim : {MeshDim::kData, MeshDim::kContext, MeshDim::kExpert, MeshDim::kTensor,
                      MeshDim::kPipeline}) {
    if ((dim == MeshDim::kContext || dim == MeshDim::kExpert) && size(dim) == 1) continue;
    parts.push_back(absl::StrCat(MeshDimName(dim), " ", coord(dim), "/", size(dim)));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace tessera::trainer
