// Planning a job spec: turns a JobSpec (model, data.seq_len, batch, parallelism, precision,
// resources) plus a cluster shape into the planner's inputs, runs the search (or evaluates the
// spec's explicit layout) and returns the chosen plan with the candidates. Shared by the
// coordinator (PlanLayout RPC, `parallelism: auto` at scheduling time) and the offline
// `tessera plan`. Pure; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/layout_planner.h"
#include "planner/lora.h"
#include "tessera/v1/coordinator_service.pb.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::planner {

// The layouts this project's trainer runs: any data x tensor x pipeline parallel layout (Megatron
// tensor parallelism with vocab-parallel embedding and cross-entropy, 1F1B pipeline stages), with
// sequence parallelism (which needs tensor_parallel > 1) and activation checkpointing (none,
// selective, full); ZeRO stages 0-3 when tensor_parallel and pipeline_parallel are 1, ZeRO 0 or 1
// otherwise (max_zero_with_model_parallel). `parallelism: auto` chooses among these when
// scheduling; the planner (and `tessera plan`) can still estimate every layout. Context and
// expert parallelism and interleaved stages are searched at any degree layout_rules.h allows; ep
// takes the same ZeRO 0-1 cap as tp and pp; a mixture of experts is not context-parallel.
SearchLimits TrainerCapabilities();

// OK when the trainer runs an explicit `layout` (TrainerCapabilities()); otherwise UNIMPLEMENTED
// naming the first field it does not run and what runs instead, e.g.
// "parallelism.layout.zero_stage: 2 with tensor_parallel 2: this trainer does not run ZeRO 2
// together with tensor or pipeline parallelism (...); set zero_stage to 1 (...), or ...".
// UNIMPLEMENTED, not INVALID_ARGUMENT: the layout is well formed and the planner estimates it;
// what is missing is the trainer's support. Checks only the degrees and the ZeRO stage; the
// structural rules are ValidateJobSpec's and InvalidReason's.
absl::Status CheckTrainerRuns(const v1::Layout& layout);

// OK when the trainer runs LoRA (JobSpec.lora) on an explicit `layout`: data and tensor
// parallelism (adapters split like their base layers), with expert parallelism folded into data
// parallelism (the experts' adapters sharded like the experts), ZeRO 0 or 1, no pipeline stages;
// UNIMPLEMENTED naming the fields otherwise.
absl::Status CheckTrainerRunsLora(const v1::Layout& layout);

struct JobPlanOptions {
  // Devices to plan for; 0 uses resources.gpus (or resources.cpu_slots when gpus is 0).
  int devices = 0;
  // Devices per node; must be > 0.
  int devices_per_node = 0;
  // The device model (already resolved from a preset, a GPU name and overrides).
  v1::DeviceModel device;
  // LoRA adapter rank (on every linear layer) when the spec has no lora; 0 plans full training.
  int lora_rank = 0;
  // Restrict automatic layouts to what the trainer runs (TrainerCapabilities()).
  bool runnable_only = false;
  // The spec's model as resolved at submission for its data.seq_len (LayoutPlan.model); unset
  // resolves spec.model here (ResolveModel, which reads a from_pretrained config.json).
  std::optional<v1::ModelSummary> model;
  // The spec's lora as resolved at submission (LayoutPlan.lora); unset resolves spec.lora here.
  std::optional<ResolvedLora> lora;
};

struct JobPlan {
  // The chosen plan (fits = false when nothing fits; its explanation says why).
  v1::LayoutPlan plan;
  // Everything considered, best first (see SearchLayouts).
  std::vector<v1::LayoutCandidate> candidates;
};

// Plans `spec`. Only the fields planning needs are checked: model, data.seq_len,
// batch.global_batch_size (> 0), batch.micro_batch_size (>= 0; 0 searches micro-batches), the
// parallelism limits or explicit layout's degrees, precision; INVALID_ARGUMENT naming the field
// otherwise. An explicit layout is evaluated as given (over the micro-batches when the spec's is
// 0); an automatic one is searched within spec.parallelism.auto_layout's limits.
absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const JobPlanOptions& options);

// The device a job is planned for, and how many of them a node holds.
struct DeviceTarget {
  v1::DeviceModel device;
  int devices_per_node = 0;
  // The registered GPU name the target was taken from ("" for a CPU or a hypothetical device).
  std::string gpu_name;
};

// Coordinator.PlanLayout's rules, for the coordinator and the offline CLI alike: the target is the
// request's device (a preset name, or gpu_type, plus overrides), else `live` (the registered
// cluster's; its error is returned, with a hint to name a device, when it has none); gpus and
// gpus_per_node override the spec's and the target's. Up to max_candidates (0: 10) candidates
// follow the chosen plan.
absl::StatusOr<v1::PlanLayoutResponse> PlanLayoutRequest(const v1::PlanLayoutRequest& request,
                                                         const absl::StatusOr<DeviceTarget>& live);

}  // namespace tessera::planner
