// Admission checks for submitted training jobs, and the layout plan of an admitted one. Everything
// a JobSpec gets wrong is found here, at submission, with a message naming the field, so that a
// job never fails on a worker for a reason its spec already showed. The plan made here is
// provisional: the scheduler replaces it with the layout planner's (planner/job_plan.h) for the
// devices the job gets (coordinator/admission/layout_planning.h).
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/lora.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::coordinator {

// Longest job name and label key or value (a DNS label's length).
inline constexpr int kMaxNameLength = 63;
// Bounds on a spec's size, so one submission cannot make the coordinator
// store, plan or replay an unbounded amount of text.
inline constexpr size_t kMaxSpecBytes = 256 << 10;
inline constexpr int kMaxShardPatterns = 4096;
inline constexpr int kMaxPathLength = 4096;
inline constexpr int kMaxLabels = 64;
// Bounds of JobSpec.priority.
inline constexpr int kMinPriority = -1000;
inline constexpr int kMaxPriority = 1000;
// ZeRO stages are 0 (none) to 3 (parameters sharded).
inline constexpr int kMaxZeroStage = 3;

// A spec resolved once, at submission: what the plan records (LayoutPlan.model, .settings,
// .precision, .world_size) and the scheduler and the trainer then read, instead of each resolving
// the spec again.
struct ResolvedJob {
  // The model at data.seq_len (planner::ResolveModel; a from_pretrained config.json is read here,
  // once).
  v1::ModelSummary model;
  // Every default the spec leaves open (planner::ResolveTrainingSettings).
  v1::TrainingSettings settings;
  // The precision it trains in (planner::ResolvePrecision for the resources it asks for).
  v1::Precision precision = v1::PRECISION_UNSPECIFIED;
  // resources.gpus, or resources.cpu_slots when gpus is 0.
  int world_size = 0;
  // The spec's lora for the model (planner::ResolveLora); unset without lora.
  std::optional<planner::ResolvedLora> lora;
};

// Validates `spec` (ValidateJobSpec's rules and errors) and resolves it. Pure function;
// thread-safe.
absl::StatusOr<ResolvedJob> ResolveJob(const v1::JobSpec& spec);

// OK when the spec can run; otherwise INVALID_ARGUMENT for the first problem in the proto's field
// order (name, model, data, batch, parallelism, optimizer, precision, max_steps, checkpoint,
// resources, priority, max_restarts, labels). The message starts with the field path, states the
// value and the rule, e.g. "batch.global_batch_size: 100 is not divisible by micro_batch_size 4 x
// data_parallel 8 (= 32)". A rule spanning fields is reported at the field that states it, and only
// once the fields it depends on are valid themselves (else their own error is reported). NaN and
// infinite doubles are refused everywhere. Pure function; thread-safe.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// OK when the trainer runs the spec's layout; UNIMPLEMENTED naming the field otherwise (today an
// explicit zero_stage 2 or 3 with tensor_parallel or pipeline_parallel > 1: see
// planner::CheckTrainerRuns for the rule and why UNIMPLEMENTED). Separate from ValidateJobSpec,
// which says whether a spec is well formed (and `tessera plan` still estimates such layouts):
// SubmitJob applies both, this one after ValidateJobSpec accepted the spec. Pure function;
// thread-safe.
absl::Status ValidateTrainerRuns(const v1::JobSpec& spec);

// The provisional plan of `spec` as `resolved` (ResolveJob(spec)). An explicit layout is used as
// given; an automatic one (or unset parallelism) becomes data_parallel = world size, tensor and
// pipeline parallel 1, ZeRO stage 0, until the scheduler plans it (`explanation` says which).
// `model`, `settings`, `precision` and `world_size` are the resolved ones; `fits` is true and
// `memory` and `step_time` are left empty until then. Pure function; thread-safe.
v1::LayoutPlan PlanJob(const v1::JobSpec& spec, const ResolvedJob& resolved);

// ResolveJob, then PlanJob: the plan for a spec that ValidateJobSpec accepts (its error
// otherwise).
absl::StatusOr<v1::LayoutPlan> PlanJob(const v1::JobSpec& spec);

}  // namespace tessera::coordinator
