// The model step of building a training run: one rank's part of the transformer built for its
// partition (its tensor-parallel split and pipeline stage, computed by trainer/parallel's
// tensor_parallelism.h and pipeline_parallelism.h), then what is applied to the built model in
// order: Hugging Face weights (model.from_pretrained), LoRA adapters with the base frozen, the move
// to the training device, and activation checkpointing. Data parallelism and ZeRO come after, in
// the engine (trainer/engine/data_parallelism.h).
//
// Thread safety: plain functions; BuildModel reseeds LibTorch's global CPU generator, so one
// thread builds at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/lora.h"
#include "tessera/v1/job.pb.h"
#include "trainer/model/model.h"

namespace tessera::trainer {

struct ModelBuildOptions {
  // Resolved (planner::ResolveModel).
  v1::ModelDims dims;
  double init_std = 0;
  // LibTorch's CPU generator is seeded with it just before the parameters are drawn.
  uint64_t seed = 0;
  ModelPartition partition;
  // ParameterStorage::kDeferred (ZeRO-3 without LoRA): no memory until the engine gives it.
  bool deferred = false;
  // A Hugging Face model directory to read this rank's part from; empty for none.
  std::string from_pretrained;
  // LoRA fine-tuning as the plan resolved it (LayoutPlan.lora); unset for full training.
  std::optional<planner::ResolvedLora> lora;
  torch::Device device = torch::kCPU;
  // With LoRA, the frozen base is held in bf16 on the device.
  bool bf16 = false;
  v1::ActivationCheckpointing checkpointing = v1::ACTIVATION_CHECKPOINTING_NONE;
};

struct BuiltModel {
  CausalLM model{nullptr};
  // Set with LoRA.
  std::optional<planner::ResolvedLora> lora;
  // Where a deferred model's shards come from (ShardedEngine::InitializeShards): the drawn
  // initial values, or the Hugging Face files.
  ParameterValues initial_values;
};

// Builds the model as above. The errors of from_pretrained carry FromPretrainedError's prefix.
// LibTorch's c10::Error passes through as thrown.
absl::StatusOr<BuiltModel> BuildModel(const ModelBuildOptions& options);

// `status` with "model.from_pretrained: " before its message.
absl::Status FromPretrainedError(const absl::Status& status);

// Casts the frozen parameters to bf16 in place: the base of a LoRA model is only read, and held in
// the compute precision it takes half the memory, as the planner's LoRA model assumes. The
// adapters stay float32 for AdamW.
void HoldFrozenInBf16(CausalLMImpl& model);

}  // namespace tessera::trainer
