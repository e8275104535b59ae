// Pipeline parallelism applied to a run: what the model's depth must allow for a pp split, which
// contiguous block of layers this rank's stage holds, and the 1F1B schedule (pipeline.h) that
// connects the stages. The model is built with the stage's layers (ModelPartition); the training
// loop drives the schedule.
//
// Thread safety: plain functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "tessera/v1/model.pb.h"
#include "trainer/parallel/mesh.h"
#include "trainer/parallel/pipeline.h"

namespace tessera::trainer {

// This rank's pipeline stage and the layers it holds (global indices).
struct PipelineStage {
  int stage = 0;
  int stages = 1;
  int first_layer = 0;
  int num_layers = 0;
  // The first stage holds the embeddings, the last the final norm, the head and the loss.
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

// INVALID_ARGUMENT naming parallelism.layout.pipeline_parallel when `pp` does not divide the
// model's layers.
absl::Status CheckPipelineSplits(const v1::ModelDims& dims, int pp);

// The stage of this rank on `mesh`: num_layers / pp consecutive layers per stage.
PipelineStage PipelineStageOf(const DeviceMesh& mesh, int num_layers);

// The 1F1B schedule of this rank's stage, sending activations of `activation_shape` on `device`
// between the stages of its (dp, tp) line; std::nullopt without pipeline parallelism.
std::optional<PipelineSchedule> MakePipelineSchedule(const DeviceMesh& mesh,
                                                     std::vector<int64_t> activation_shape,
                                                     at::Device device);

}  // namespace tessera::trainer
