#include "trainer/parallel/tensor_parallelism.h"

namespace tessera::trainer {

TensorParallel TensorParallelOf(const DeviceMesh& mesh, bool sequence_parallel) {
  const int size = mesh.size(MeshDim::kTensor);
  return TensorParallel{.group = mesh.group(MeshDim::kTensor),
                        .rank = mesh.coord(MeshDim::kTensor),
                        .size = size,
                        .sequence_parallel = size > 1 && sequence_parallel};
}

}  // namespace tessera::trainer
