// A job's ranks arranged as a grid of named parallel dimensions (torchtitan's ParallelDims, c10d's
// DeviceMesh): pipeline outermost, then data, then tensor innermost, so that a tensor-parallel
// group is consecutive ranks (one node) and a pipeline stage is a contiguous block. Each rank
// knows its coordinate along every dimension and holds a c10d group per dimension over the ranks
// that differ from it only along that dimension. Groups of size 1 are absent (collectives over one
// rank are no-ops the caller skips); a dimension spanning the whole world reuses the world group.
//
// Thread safety: immutable after Create; the c10d groups follow c10d's rules (one collective
// stream per group, issued in the same order on every member).
#pragma once

#include <array>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tessera/v1/layout.pb.h"
#include "trainer/parallel/distributed.h"

namespace tessera::trainer {

enum class MeshDim { kPipeline = 0, kData = 1, kTensor = 2 };
inline constexpr int kMeshDims = 3;

// "pp", "dp" or "tp".
const char* MeshDimName(MeshDim dim);

struct MeshShape {
  int pp = 1;
  int dp = 1;
  int tp = 1;
  int world() const { return pp * dp * tp; }
  int size(MeshDim dim) const;
};

// The mesh a layout asks for on `world_size` ranks: data_parallel 0 means "the rest of the world".
// INVALID_ARGUMENT naming the layout field when a degree is negative or the product is not the
// world size.
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
  int coord(MeshDim dim) const { return coords_[static_cast<int>(dim)]; }
  // The group along `dim`; null when size(dim) == 1.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group(MeshDim dim) const {
    return groups_[static_cast<int>(dim)];
  }
  // "dp 1/2, tp 0/1, pp 0/1" for logs.
  std::string Describe() const;

  // The global rank at `coords` (pp, dp, tp).
  static int RankAt(const MeshShape& shape, const std::array<int, kMeshDims>& coords);

 private:
  MeshShape shape_;
  int rank_ = 0;
  std::array<int, kMeshDims> coords_{0, 0, 0};
  std::array<c10::intrusive_ptr<c10d::ProcessGroup>, kMeshDims> groups_;
};

}  // namespace tessera::trainer
