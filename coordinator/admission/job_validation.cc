#include "coordinator/admission/job_validation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "planner/hf_config.h"
#include "planner/job_plan.h"
#include "planner/layout_rules.h"
#include "planner/lora.h"
#include "planner/lr_schedule.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"

namespace tessera::coordinator {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

// NaN compares false with everything, so every range check on a double goes through here first.
absl::Status CheckFinite(absl::string_view field, double value) {
  if (std::isfinite(value)) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be a finite number, got ", value));
}

absl::Status CheckNonNegative(absl::string_view field, int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be >= 0, got ", value));
}

absl::Status CheckFiniteNonNegative(absl::string_view field, double value) {
  RETURN_IF_ERROR(CheckFinite(field, value));
  if (value >= 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be >= 0, got ", value));
}

absl::Status CheckPositive(absl::string_view field, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be > 0, got ", value));
}

// Adam betas: 0 picks the default, 1 would never forget.
absl::Status CheckBeta(absl::string_view field, double value) {
  RETURN_IF_ERROR(CheckFinite(field, value));
  if (value >= 0 && value < 1) return absl::OkStatus();
  return Invalid(field, absl::StrCat("must be in [0, 1), got ", value));
}

bool IsLowerAlnumOrHyphen(char c) {
  return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-';
}

bool IsLabelKeyChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

// Where the world size comes from, for messages: "resources.gpus 8" or "resources.cpu_slots 2".
std::string WorldSizeSource(const v1::ResourceRequest& resources) {
  return resources.gpus() > 0 ? absl::StrCat("resources.gpus ", resources.gpus())
                              : absl::StrCat("resources.cpu_slots ", resources.cpu_slots());
}

// The job's world size, or nullopt while the resources are invalid (their own check says why).
std::optional<int> WorldSize(const v1::ResourceRequest& resources) {
  if (resources.gpus() < 0 || resources.cpu_slots() < 0) return std::nullopt;
  if (resources.gpus() > 0) return resources.gpus();
  if (resources.cpu_slots() > 0) return resources.cpu_slots();
  return std::nullopt;
}

bool HasExplicitLayout(const v1::JobSpec& spec) {
  return spec.parallelism().choice_case() == v1::ParallelismSpec::kLayout;
}

// The data-parallel degree the batch is split over, or nullopt while it cannot be known yet (an
// invalid layout degree or invalid resources; their own checks say why).
std::optional<int64_t> DataParallel(const v1::JobSpec& spec) {
  if (HasExplicitLayout(spec)) {
    const int dp = spec.parallelism().layout().data_parallel();
    return dp >= 1 ? std::optional<int64_t>(dp) : std::nullopt;
  }
  return WorldSize(spec.resources());
}

// Micro-batches per step per data-parallel rank, once ValidateBatch accepted the batch; else 0.
int64_t MicroBatchesPerStep(const v1::JobSpec& spec) {
  const std::optional<int64_t> dp = DataParallel(spec);
  const int64_t per_pass = int64_t{spec.batch().micro_batch_size()} * dp.value_or(0);
  if (per_pass <= 0 || spec.batch().global_batch_size() % per_pass != 0) return 0;
  return spec.batch().global_batch_size() / per_pass;
}

absl::Status ValidateName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameLength) {
    return Invalid("name",
                   absl::StrCat("must be 1-", kMaxNameLength, " characters, got ", name.size()));
  }
  if (!absl::ascii_islower(name[0])) {
    return Invalid("name", absl::StrCat("'", name, "' must start with a letter a-z"));
  }
  if (!std::all_of(name.begin(), name.end(), IsLowerAlnumOrHyphen)) {
    return Invalid("name", absl::StrCat("'", name, "' may hold only a-z, 0-9 and '-'"));
  }
  return absl::OkStatus();
}

absl::Status ValidateShards(absl::string_view field,
                            const google::protobuf::RepeatedPtrField<std::string>& shards) {
  if (shards.size() > kMaxShardPatterns) {
    return Invalid(field, absl::StrCat("at most ", kMaxShardPatterns,
                                       " paths or globs (use a glob), got ", shards.size()));
  }
  for (int i = 0; i < shards.size(); ++i) {
    if (shards[i].empty()) {
      return Invalid(absl::StrCat(field, "[", i, "]"), "must be a non-empty path or glob");
    }
    if (shards[i].size() > kMaxPathLength) {
      return Invalid(absl::StrCat(field, "[", i, "]"),
                     absl::StrCat("longer than ", kMaxPathLength, " characters"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateData(const v1::DataSpec& data, const v1::ModelDims& dims) {
  if (data.train_shards().empty()) {
    return Invalid("data.train_shards", "at least one path or glob is required");
  }
  RETURN_IF_ERROR(ValidateShards("data.train_shards", data.train_shards()));
  RETURN_IF_ERROR(ValidateShards("data.validation_shards", data.validation_shards()));
  if (data.eval_interval_steps() > 0 && data.validation_shards().empty()) {
    return Invalid("data.validation_shards",
                   absl::StrCat("at least one path or glob is required when "
                                "data.eval_interval_steps is ",
                                data.eval_interval_steps(), " (> 0)"));
  }
  RETURN_IF_ERROR(planner::CheckSeqLen(dims, data.seq_len()));
  RETURN_IF_ERROR(CheckNonNegative("data.eval_interval_steps", data.eval_interval_steps()));
  RETURN_IF_ERROR(CheckNonNegative("data.eval_batches", data.eval_batches()));
  return absl::OkStatus();
}

absl::Status ValidateBatch(const v1::JobSpec& spec) {
  const v1::BatchSpec& batch = spec.batch();
  RETURN_IF_ERROR(CheckPositive("batch.global_batch_size", batch.global_batch_size()));
  RETURN_IF_ERROR(CheckPositive("batch.micro_batch_size", batch.micro_batch_size()));
  const std::optional<int64_t> dp = DataParallel(spec);
  if (!dp.has_value()) return absl::OkStatus();
  // Both factors are below 2^31, so the product cannot overflow.
  const int64_t per_pass = int64_t{batch.micro_batch_size()} * *dp;
  if (batch.global_batch_size() % per_pass != 0) {
    return Invalid(
        "batch.global_batch_size",
        absl::StrCat(batch.global_batch_size(), " is not divisible by micro_batch_size ",
                     batch.micro_batch_size(), " x data_parallel ", *dp, " (= ", per_pass, ")"));
  }
  if (batch.global_batch_size() / per_pass > INT32_MAX) {
    return Invalid(
        "batch.global_batch_size",
        absl::StrCat(batch.global_batch_size(), " / (micro_batch_size ", batch.micro_batch_size(),
                     " x data_parallel ", *dp, ") = ", batch.global_batch_size() / per_pass,
                     " gradient accumulation steps, more than ", INT32_MAX));
  }
  return absl::OkStatus();
}

// `micro_batches_per_step` is the batch's per data-parallel rank (0 while the batch is invalid).
absl::Status ValidateExplicitLayout(const v1::Layout& layout, const v1::ResourceRequest& resources,
                                    const v1::ModelDims& dims, int seq_len,
                                    int64_t micro_batches_per_step) {
  const struct {
    const char* name;
    int value;
  } degrees[] = {{"data_parallel", layout.data_parallel()},
                 {"tensor_parallel", layout.tensor_parallel()},
                 {"pipeline_parallel", layout.pipeline_parallel()}};
  for (const auto& degree : degrees) {
    if (degree.value < 1) {
      return Invalid(absl::StrCat("parallelism.layout.", degree.name),
                     absl::StrCat("must be >= 1 in an explicit layout (0 does not mean a default; "
                                  "use auto_layout to let the planner choose), got ",
                                  degree.value));
    }
  }
  if (layout.zero_stage() < 0 || layout.zero_stage() > kMaxZeroStage) {
    return Invalid("parallelism.layout.zero_stage",
                   absl::StrCat("must be in 0..", kMaxZeroStage, ", got ", layout.zero_stage()));
  }
  // Context parallelism multiplies the ranks (each sequence is split over cp of them); expert
  // parallelism does not (its ranks are data-parallel ranks).
  const int cp = std::max(1, layout.context_parallel());
  for (const auto& [name, value] :
       {std::pair<const char*, int>{"context_parallel", layout.context_parallel()},
        {"expert_parallel", layout.expert_parallel()},
        {"pipeline_virtual_stages", layout.pipeline_virtual_stages()}}) {
    if (value < 0) {
      return Invalid(absl::StrCat("parallelism.layout.", name),
                     absl::StrCat("must be >= 0 (0 means 1), got ", value));
    }
  }
  const int64_t world =
      int64_t{layout.data_parallel()} * layout.tensor_parallel() * layout.pipeline_parallel() * cp;
  if (std::optional<int> requested = WorldSize(resources);
      requested.has_value() && world != *requested) {
    return Invalid(
        "parallelism.layout",
        absl::StrCat("data_parallel ", layout.data_parallel(), " x tensor_parallel ",
                     layout.tensor_parallel(), " x pipeline_parallel ", layout.pipeline_parallel(),
                     cp > 1 ? absl::StrCat(" x context_parallel ", cp) : "", " = ", world,
                     " != ", WorldSizeSource(resources)));
  }
  const int tp = layout.tensor_parallel();
  if (const auto violation =
          planner::CheckModelDivisibility(dims, tp, layout.pipeline_parallel())) {
    return Invalid(violation->field, violation->problem);
  }
  if (const auto violation =
          planner::CheckSplitRules(dims, seq_len,
                                   {.data_parallel = layout.data_parallel(),
                                    .pipeline_parallel = layout.pipeline_parallel(),
                                    .context_parallel = layout.context_parallel(),
                                    .expert_parallel = layout.expert_parallel(),
                                    .pipeline_virtual_stages = layout.pipeline_virtual_stages(),
                                    .tensor_parallel = tp,
                                    .sequence_parallel = layout.sequence_parallel(),
                                    .micro_batches_per_step = micro_batches_per_step})) {
    return Invalid(violation->field, violation->problem);
  }
  if (layout.sequence_parallel() && tp == 1) {
    return Invalid("parallelism.layout.sequence_parallel",
                   "needs tensor_parallel > 1, got tensor_parallel 1");
  }
  return absl::OkStatus();
}

absl::Status ValidateAutoLayout(const v1::AutoLayoutSpec& auto_layout) {
  RETURN_IF_ERROR(CheckNonNegative("parallelism.auto_layout.max_tensor_parallel",
                                   auto_layout.max_tensor_parallel()));
  RETURN_IF_ERROR(CheckNonNegative("parallelism.auto_layout.max_pipeline_parallel",
                                   auto_layout.max_pipeline_parallel()));
  if (auto_layout.has_max_zero_stage() &&
      (auto_layout.max_zero_stage() < 0 || auto_layout.max_zero_stage() > kMaxZeroStage)) {
    return Invalid(
        "parallelism.auto_layout.max_zero_stage",
        absl::StrCat("must be in 0..", kMaxZeroStage, ", got ", auto_layout.max_zero_stage()));
  }
  const double headroom = auto_layout.memory_headroom_fraction();
  RETURN_IF_ERROR(CheckFinite("parallelism.auto_layout.memory_headroom_fraction", headroom));
  if (headroom < 0 || headroom > 1) {
    return Invalid("parallelism.auto_layout.memory_headroom_fraction",
                   absl::StrCat("must be in [0, 1] (0 for the default 0.9), got ", headroom));
  }
  RETURN_IF_ERROR(CheckNonNegative("parallelism.auto_layout.max_context_parallel",
                                   auto_layout.max_context_parallel()));
  RETURN_IF_ERROR(CheckNonNegative("parallelism.auto_layout.max_expert_parallel",
                                   auto_layout.max_expert_parallel()));
  RETURN_IF_ERROR(CheckNonNegative("parallelism.auto_layout.max_pipeline_virtual_stages",
                                   auto_layout.max_pipeline_virtual_stages()));
  return absl::OkStatus();
}

absl::Status ValidateOptimizer(const v1::OptimizerSpec& optimizer, int64_t max_steps) {
  const v1::LearningRateSchedule& schedule = optimizer.schedule();
  // ValidateSchedule's range check on min_lr_ratio lets NaN through, and it checks max_steps (a
  // later field) last: check the fields before min_lr_ratio, then min_lr_ratio, then the rest, so
  // the first problem in field order is the one reported.
  const int64_t steps_for_schedule = std::max<int64_t>(max_steps, 1);
  if (std::isnan(schedule.min_lr_ratio())) {
    v1::LearningRateSchedule leading_fields;
    leading_fields.set_peak_learning_rate(schedule.peak_learning_rate());
    leading_fields.set_warmup_steps(schedule.warmup_steps());
    RETURN_IF_ERROR(planner::ValidateSchedule(leading_fields, steps_for_schedule));
    RETURN_IF_ERROR(CheckFinite("optimizer.schedule.min_lr_ratio", schedule.min_lr_ratio()));
  }
  RETURN_IF_ERROR(planner::ValidateSchedule(schedule, steps_for_schedule));
  RETURN_IF_ERROR(CheckFiniteNonNegative("optimizer.weight_decay", optimizer.weight_decay()));
  RETURN_IF_ERROR(CheckBeta("optimizer.beta1", optimizer.beta1()));
  RETURN_IF_ERROR(CheckBeta("optimizer.beta2", optimizer.beta2()));
  RETURN_IF_ERROR(CheckFiniteNonNegative("optimizer.epsilon", optimizer.epsilon()));
  RETURN_IF_ERROR(CheckFiniteNonNegative("optimizer.grad_clip_norm", optimizer.grad_clip_norm()));
  return absl::OkStatus();
}

absl::Status ValidatePrecision(v1::Precision precision, const v1::ResourceRequest& resources) {
  if (!v1::Precision_IsValid(precision)) {
    return Invalid("precision", absl::StrCat("unknown value ", static_cast<int>(precision)));
  }
  // A negative gpus is reported by its own check under resources.
  if (precision == v1::PRECISION_BF16 && resources.gpus() == 0) {
    return Invalid("precision",
                   "PRECISION_BF16 is CUDA only and needs resources.gpus > 0, got gpus 0; use "
                   "PRECISION_FP32 or PRECISION_UNSPECIFIED on CPU slots");
  }
  return absl::OkStatus();
}

absl::Status ValidateResources(const v1::ResourceRequest& resources) {
  RETURN_IF_ERROR(CheckNonNegative("resources.gpus", resources.gpus()));
  RETURN_IF_ERROR(CheckNonNegative("resources.cpu_slots", resources.cpu_slots()));
  if (resources.gpus() == 0 && resources.cpu_slots() == 0) {
    return Invalid("resources", "request gpus or cpu_slots; both are 0");
  }
  return absl::OkStatus();
}

absl::Status ValidateLabels(const google::protobuf::Map<std::string, std::string>& labels) {
  if (labels.size() > kMaxLabels) {
    return Invalid("labels", absl::StrCat("at most ", kMaxLabels, ", got ", labels.size()));
  }
  // Map order is unspecified; sort so the same spec always reports the same label.
  std::vector<std::string> keys;
  keys.reserve(labels.size());
  for (const auto& [key, value] : labels) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  for (const std::string& key : keys) {
    if (key.empty() || key.size() > kMaxNameLength) {
      return Invalid("labels", absl::StrCat("key '", key, "' must be 1-", kMaxNameLength,
                                            " characters, got ", key.size()));
    }
    if (!std::all_of(key.begin(), key.end(), IsLabelKeyChar)) {
      return Invalid("labels",
                     absl::StrCat("key '", key, "' may hold only a-z, A-Z, 0-9, '.', '_' and '-'"));
    }
    const std::string& value = labels.at(key);
    if (value.empty() || value.size() > kMaxNameLength) {
      return Invalid(
          absl::StrCat("labels[", key, "]"),
          absl::StrCat("value must be 1-", kMaxNameLength, " characters, got ", value.size()));
    }
  }
  return absl::OkStatus();
}

// The loss-spike guard: factors are off (0) or > 1, since a factor <= 1 would call half of all
// steps (the median's upper half) spikes; a window of one step has no median worth the name.
// A level name is the form --topology_levels takes (coordinator/scheduler/topology.h); whether the
// cluster has it is the coordinator's to check (CheckPlacementLevels).
absl::Status ValidatePlacement(const v1::PlacementSpec& placement) {
  if (!placement.required().empty() && !placement.preferred().empty()) {
    return Invalid("placement", absl::StrCat("set required or preferred, not both; got required '",
                                             placement.required(), "' and preferred '",
                                             placement.preferred(), "'"));
  }
  for (const auto& [field, level] :
       {std::pair<const char*, const std::string&>{"placement.required", placement.required()},
        {"placement.preferred", placement.preferred()}}) {
    const bool named = std::all_of(level.begin(), level.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    });
    if (!named) {
      return Invalid(field,
                     absl::StrCat("'", level, "' is not a topology level name (a-z, 0-9 and '-')"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateGuard(const v1::GuardSpec& guard) {
  const auto check_factor = [](absl::string_view field, double factor) -> absl::Status {
    RETURN_IF_ERROR(CheckFinite(field, factor));
    if (factor == 0 || factor > 1) return absl::OkStatus();
    return Invalid(field, absl::StrCat("must be > 1 (or 0: off), got ", factor));
  };
  RETURN_IF_ERROR(check_factor("guard.loss_spike_factor", guard.loss_spike_factor()));
  RETURN_IF_ERROR(check_factor("guard.grad_norm_spike_factor", guard.grad_norm_spike_factor()));
  if (guard.window() != 0 && guard.window() < 2) {
    return Invalid("guard.window", absl::StrCat("must be >= 2 (or 0: 20), got ", guard.window()));
  }
  RETURN_IF_ERROR(CheckNonNegative("guard.max_rollbacks", guard.max_rollbacks()));
  RETURN_IF_ERROR(CheckNonNegative("guard.skip_batches", guard.skip_batches()));
  for (int i = 0; i < guard.skipped_size(); ++i) {
    RETURN_IF_ERROR(
        CheckPositive(absl::StrCat("guard.skipped[", i, "].step"), guard.skipped(i).step()));
    RETURN_IF_ERROR(
        CheckPositive(absl::StrCat("guard.skipped[", i, "].batches"), guard.skipped(i).batches()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResolvedJob> ResolveJob(const v1::JobSpec& spec) {
  if (const size_t bytes = spec.ByteSizeLong(); bytes > kMaxSpecBytes) {
    return Invalid("spec", absl::StrCat(bytes, " bytes encoded; at most ", kMaxSpecBytes));
  }
  RETURN_IF_ERROR(ValidateName(spec.name()));
  // The model's own fields come before data.seq_len, so resolve at seq_len 1 (always valid) here
  // and check the real seq_len with the data.
  ASSIGN_OR_RETURN(const v1::ModelSummary model, planner::ResolveModel(spec.model(), 1));
  RETURN_IF_ERROR(ValidateData(spec.data(), model.dims()));
  RETURN_IF_ERROR(ValidateBatch(spec));
  if (HasExplicitLayout(spec)) {
    RETURN_IF_ERROR(ValidateExplicitLayout(spec.parallelism().layout(), spec.resources(),
                                           model.dims(), spec.data().seq_len(),
                                           MicroBatchesPerStep(spec)));
  } else {
    RETURN_IF_ERROR(ValidateAutoLayout(spec.parallelism().auto_layout()));
  }
  // With `epochs` the trainer knows max_steps only once it has opened the shards: the schedule's
  // step counts are checked against it there.
  RETURN_IF_ERROR(ValidateOptimizer(
      spec.optimizer(), spec.epochs() > 0 ? std::numeric_limits<int64_t>::max() : spec.max_steps()));
  std::optional<planner::ResolvedLora> lora;
  if (spec.has_lora()) {
    ASSIGN_OR_RETURN(lora, planner::ResolveLora(spec.lora(), model.dims()));
  }
  RETURN_IF_ERROR(ValidatePrecision(spec.precision(), spec.resources()));
  if (spec.epochs() != 0) {
    if (!std::isfinite(spec.epochs()) || spec.epochs() < 0) {
      return Invalid("epochs", absl::StrCat("must be > 0, got ", spec.epochs()));
    }
    if (spec.max_steps() != 0) {
      return Invalid("epochs", absl::StrCat("set max_steps (", spec.max_steps(), ") or epochs (",
                                            spec.epochs(), "), not both"));
    }
  } else {
    RETURN_IF_ERROR(CheckPositive("max_steps", spec.max_steps()));
  }
  RETURN_IF_ERROR(
      CheckNonNegative("checkpoint.interval_steps", spec.checkpoint().interval_steps()));
  RETURN_IF_ERROR(CheckNonNegative("checkpoint.keep_last", spec.checkpoint().keep_last()));
  RETURN_IF_ERROR(planner::CheckExportPolicy(spec, model.dims()));
  RETURN_IF_ERROR(ValidateResources(spec.resources()));
  if (spec.priority() < kMinPriority || spec.priority() > kMaxPriority) {
    return Invalid("priority", absl::StrCat("must be in [", kMinPriority, ", ", kMaxPriority,
                                            "], got ", spec.priority()));
  }
  RETURN_IF_ERROR(CheckNonNegative("max_restarts", spec.max_restarts()));
  RETURN_IF_ERROR(CheckNonNegative("hang_timeout_seconds", spec.hang_timeout_seconds()));
  RETURN_IF_ERROR(ValidateLabels(spec.labels()));
  RETURN_IF_ERROR(ValidatePlacement(spec.placement()));
  if (spec.has_guard()) RETURN_IF_ERROR(ValidateGuard(spec.guard()));
  ResolvedJob resolved;
  // ValidateData accepted data.seq_len for these dimensions.
  ASSIGN_OR_RETURN(resolved.model, planner::ModelForSeqLen(model, spec.data().seq_len()));
  resolved.settings = planner::ResolveTrainingSettings(spec);
  resolved.precision = planner::ResolvePrecision(spec.precision(), spec.resources().gpus() > 0);
  // ValidateResources accepted the resources, so the world size is known.
  resolved.world_size = *WorldSize(spec.resources());
  resolved.lora = std::move(lora);
  return resolved;
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) { return ResolveJob(spec).status(); }

absl::Status ValidateTrainerRuns(const v1::JobSpec& spec) {
  // An automatic layout is chosen among what the trainer runs when the job is scheduled.
  if (!HasExplicitLayout(spec)) return absl::OkStatus();
  if (spec.has_lora()) RETURN_IF_ERROR(planner::CheckTrainerRunsLora(spec.parallelism().layout()));
  return planner::CheckTrainerRuns(spec.parallelism().layout());
}

v1::LayoutPlan PlanJob(const v1::JobSpec& spec, const ResolvedJob& resolved) {
  v1::LayoutPlan plan;
  *plan.mutable_model() = resolved.model;
  *plan.mutable_settings() = resolved.settings;
  if (resolved.lora.has_value()) *plan.mutable_lora() = planner::ToLoraPlan(*resolved.lora);
  plan.set_precision(resolved.precision);
  const int world = resolved.world_size;
  const char* device = spec.resources().gpus() > 0 ? "GPUs" : "CPU slots";
  v1::Layout& layout = *plan.mutable_layout();
  if (HasExplicitLayout(spec)) {
    layout = spec.parallelism().layout();
    // The newer degrees are named only when used, so plain layouts read as before.
    std::string split;
    if (layout.context_parallel() > 1) {
      absl::StrAppend(&split, " x context_parallel ", layout.context_parallel());
    }
    if (layout.expert_parallel() > 1) {
      absl::StrAppend(&split, ", expert_parallel ", layout.expert_parallel());
    }
    if (layout.pipeline_virtual_stages() > 1) {
      absl::StrAppend(&split, ", pipeline_virtual_stages ", layout.pipeline_virtual_stages());
    }
    plan.set_explanation(absl::StrCat("Explicit layout from the job spec: data_parallel ",
                                      layout.data_parallel(), " x tensor_parallel ",
                                      layout.tensor_parallel(), " x pipeline_parallel ",
                                      layout.pipeline_parallel(), split, ", ZeRO stage ",
                                      layout.zero_stage(), ", over ", world, " ", device,
                                      ". The planner checks it against the devices the job "
                                      "gets when it is scheduled."));
  } else {
    layout.set_data_parallel(world);
    layout.set_tensor_parallel(1);
    layout.set_pipeline_parallel(1);
    layout.set_zero_stage(0);
    plan.set_explanation(absl::StrCat(
        "Provisional automatic layout: data parallelism over all ", world, " ", device,
        ". The layout planner chooses the layout when the job is scheduled, for the devices it "
        "gets, and records it here with its memory and step-time estimates."));
  }
  plan.set_world_size(world);
  plan.set_lora_rank(spec.lora().rank());
  plan.set_micro_batch_size(spec.batch().micro_batch_size());
  plan.set_gradient_accumulation_steps(
      static_cast<int32_t>(spec.batch().global_batch_size() /
                           (int64_t{spec.batch().micro_batch_size()} * layout.data_parallel())));
  plan.set_fits(true);
  return plan;
}

absl::StatusOr<v1::LayoutPlan> PlanJob(const v1::JobSpec& spec) {
  ASSIGN_OR_RETURN(const ResolvedJob resolved, ResolveJob(spec));
  return PlanJob(spec, resolved);
}

}  // namespace tessera::coordinator
