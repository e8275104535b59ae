// Tensor parallelism (Megatron-style, with optional sequence parallelism) applied to a run: what
// the model's dimensions must allow for a tp split, and this rank's TensorParallel on the device
// mesh, which the model is then built with (ModelPartition::tp) and the engine told about. The
// split itself is tensor_parallel.h's. A new parallelism gets a file like this one and one line in
// the run builder's composition (trainer/runtime/run_builder.cc).
//
// Thread safety: plain functions of their arguments.
#pragma once

#include "absl/status/status.h"
#include "tessera/v1/model.pb.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tessera::trainer {

// This rank's tensor-parallel split: the mesh's tp group, coordinate and size; sequence
// parallelism only with tp > 1.
TensorParallel TensorParallelOf(const DeviceMesh& mesh, bool sequence_parallel);

}  // namespace tessera::trainer
