// A job's ranks arranged as a grid of named parallel dimensions (torchtitan's ParallelDims, c10d's
// DeviceMesh): pipeline outermost, then data, then context, then tensor innermost, so that a
// tensor-parallel group is consecutive ranks (one node) and a pipeline stage is a contiguous
// block. Each rank knows its coordinate along every dimension and holds a c10d group per dimension
// over the ranks that differ from it only along that dimension. Three more groups are derived
// from those:
//   ep   expert parallelism, folded into dp as torchtitan and Megatron-Core do: blocks of ep
//        consecutive dp coordinates, which split the experts between them;
//   edp  the ranks holding the same expert shard (dp coordinates equal modulo ep), over which the
//        experts' gradients are reduced;
//   dcp  dp x cp, the ranks holding the same dense parameters, over which their gradients are
//        reduced (a context-parallel rank sees part of every sequence).
// Groups of size 1 are absent (collectives over one rank are no-ops the caller skips); a group
// spanning the whole world reuses the world group, and a derived group equal to a base one reuses
// it.
//
// Thread safety: immutable after Create; the c10d groups follow c10d's rules (one collective
// stream per group, issued in the same order on every member).
#pragma once

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/layout.pb.h"
#include "trainer/parallel/distributed.h"

namespace tessera::trainer {

enum class MeshDim {
  kPipeline = 0,
  kData = 1,
  kContext = 2,
  kTensor = 3,
  // Derived groups (see above); a rank's coordinate along them follows from its dp and cp ones.
  kExpert = 4,
  kExpertData = 5,
  kDataContext = 6,
};
// The base dimensions, whose coordinates name a rank.
inline constexpr int kMeshDims = 4;
// Every group a mesh holds: the base dimensions and the derived ones.
inline constexpr int kMeshGroups = 7;

// "pp", "dp", "cp", "tp", "ep", "edp" or "dcp".
const char* MeshDimName(MeshDim dim);

struct MeshShape {
  int pp = 1;
  int dp = 1;
  int cp = 1;
  int tp = 1;
  // Expert-parallel degree; divides dp.
  int ep = 1;
  int world() const { return pp * dp * cp * tp; }
  int size(MeshDim dim) const;
};

// A rank's place along the base dimensions.
struct MeshCoords {
  int pp = 0;
  int dp = 0;
  int cp = 0;
  int tp = 0;
};

// The mesh a layout asks for on `world_size` ranks: data_parallel 0 means "the rest of the world".
// INVALID_ARGUMENT naming the layout field when a degree is negative, the product is not the
// world size, or expert_parallel does not divide data_parallel.
absl::StatusOr<MeshShape> MeshShapeForLayout(const v1::Layout& layout, int world_size);

class DeviceMesh {
 public:
  // A mesh of one rank with no groups (a single-process job).
  DeviceMesh() = default;

  // Builds the per-dimension groups of `rank` on top of `world` (null only when the mesh has one
  // rank). Sub-groups rendezvous through `world`'s store under a prefix naming the dimension and
  // the line, on the world's backend. Every rank of the job must call this with the same shape.
  static absl::StatusOr<DeviceMesh> Create(const MeshShape& shape, int rank,
                                           const JoinedGroup* world,
                                           const ProcessGroupOptions& options);

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  int size(MeshDim dim) const { return shape_.size(dim); }
  // This rank's index in the group along `dim`.
  int coord(MeshDim dim) const;
  const MeshCoords& coords() const { return coords_; }
  // The group along `dim`; null when size(dim) == 1.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group(MeshDim dim) const {
    return groups_[static_cast<int>(dim)];
  }
  // "dp 1/2, tp 0/1, pp 0/1" for logs (cp and ep when they are > 1).
  std::string Describe() const;

  // The global rank at `coords`.
  static int RankAt(const MeshShape& shape, const MeshCoords& coords);
  // The coordinates of `rank`.
  static MeshCoords CoordsOf(const MeshShape& shape, int rank);
  // The global ranks of the group along `dim` through `rank`, in group-rank order.
  static std::vector<int> GroupRanks(const MeshShape& shape, int rank, MeshDim dim);

 private:
  MeshShape shape_;
  int rank_ = 0;
  MeshCoords coords_;
  std::array<c10::intrusive_ptr<c10d::ProcessGroup>, kMeshGroups> groups_;
};

}  // namespace tessera::trainer
