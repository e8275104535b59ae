// Pipeline parallelism applied to a run: what the model's depth must allow for a pp split, which
// layers this rank's stage holds (one contiguous block, or with v virtual stages the v chunks
// s, s + pp, ... of the pp * v equal chunks, as Megatron-Core assigns them), and the 1F1B or
// interleaved 1F1B schedule (pipeline.h) that connects the stages. The model is built with the
// stage's layers (ModelPartition); the training loop drives the schedule.
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

// This rank's pipeline stage and the layers it holds (global indices): `chunks` blocks of
// `num_layers` consecutive layers, chunk j from first_layer + j * chunk_stride.
struct PipelineStage {
  int stage = 0;
  int stages = 1;
  int first_layer = 0;
  int num_layers = 0;
  int chunks = 1;
  int chunk_stride = 0;
  // The first stage holds the embeddings, the last the final norm, the head and the loss.
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

// The layout's virtual stages per pipeline stage (pipeline_virtual_stages; 0 means 1).
int VirtualStagesOf(const v1::Layout& layout);

// The stage of this rank on `mesh`: num_layers / pp layers per stage, in `virtual_stages` chunks
// of num_layers / (pp * virtual_stages) (planner::CheckSplitRules and CheckModelDivisibility must
// accept the split).
PipelineStage PipelineStageOf(const DeviceMesh& mesh, int num_layers, int virtual_stages = 1);

// The 1F1B schedule of this rank's stage (interleaved over `virtual_stages` chunks when above 1),
// sending activations of `activation_shape` on `device` between the stages of its (dp, tp)
// line; std::nullopt without pipeline parallelism.
std::optional<PipelineSchedule> MakePipelineSchedule(const DeviceMesh& mesh,
                                                     std::vector<int64_t> activation_shape,
                                                     at::Device device, int virtual_stages = 1);

}  // namespace tessera::trainer
