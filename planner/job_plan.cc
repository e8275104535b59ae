#include "planner/job_plan.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "planner/devices.h"
#include "planner/lora.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"

namespace tessera::planner {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

// What TrainerCapabilities() allows, in words, for explanations and refusals.
constexpr char kTrainerRuns[] =
    "any data x tensor x pipeline parallel layout, with sequence parallelism and activation "
    "checkpointing; ZeRO 0-3 without tensor or pipeline parallelism, ZeRO 0-1 with them";

}  // namespace

SearchLimits TrainerCapabilities() {
  SearchLimits limits;
  limits.max_tp = 0;
  limits.max_pp = 0;
  limits.max_zero = 3;
  limits.max_zero_with_model_parallel = 1;
  limits.allow_activation_checkpointing = true;
  limits.allow_sequence_parallel = true;
  // Context and expert parallelism and interleaved stages at any degree the rules allow
  // (layout_rules.h); ep under the model-parallel ZeRO cap. The trainer refuses a mixture of
  // experts with context parallelism.
  limits.max_cp = 0;
  limits.max_ep = 0;
  limits.max_v = 0;
  limits.context_parallel_with_experts = false;
  return limits;
}

absl::Status CheckTrainerRuns(const v1::Layout& layout) {
  // Derived from TrainerCapabilities() so that the refusals and `auto` agree; today only the
  // ZeRO rule can refuse.
  const SearchLimits runs = TrainerCapabilities();
  // `remedy` names what runs instead; "or use parallelism: auto" always does.
  auto refuse = [](absl::string_view field, absl::string_view value, absl::string_view what,
                   absl::string_view remedy) {
    return absl::UnimplementedError(absl::StrCat(
        "parallelism.layout.", field, ": ", value, ": this trainer does not run ", what,
        " (it runs ", kTrainerRuns, "); ", remedy, ", or use parallelism: auto"));
  };
  const int tp = layout.tensor_parallel(), pp = layout.pipeline_parallel();
  if (runs.max_tp > 0 && tp > runs.max_tp) {
    return refuse("tensor_parallel", absl::StrCat(tp),
                  absl::StrCat("tensor_parallel above ", runs.max_tp),
                  absl::StrCat("set tensor_parallel to at most ", runs.max_tp));
  }
  if (runs.max_pp > 0 && pp > runs.max_pp) {
    return refuse("pipeline_parallel", absl::StrCat(pp),
                  absl::StrCat("pipeline_parallel above ", runs.max_pp),
                  absl::StrCat("set pipeline_parallel to at most ", runs.max_pp));
  }
  if (layout.sequence_parallel() && !runs.allow_sequence_parallel) {
    return refuse("sequence_parallel", "true", "sequence parallelism",
                  "set sequence_parallel to false");
  }
  const int zero = layout.zero_stage();
  // Expert parallelism shards the routed experts over the dp / ep ranks holding the same ones, a
  // second ZeRO group: it takes the model-parallel ZeRO cap too. (Context-parallel ranks shard with
  // the data-parallel ones, over dp x cp, like plain data parallelism.)
  const int ep = layout.expert_parallel();
  if ((tp > 1 || pp > 1 || ep > 1) && zero > runs.max_zero_with_model_parallel) {
    std::vector<std::string> with;
    if (tp > 1) with.push_back(absl::StrCat("tensor_parallel ", tp));
    if (pp > 1) with.push_back(absl::StrCat("pipeline_parallel ", pp));
    if (ep > 1) with.push_back(absl::StrCat("expert_parallel ", ep));
    return refuse("zero_stage", absl::StrCat(zero, " with ", absl::StrJoin(with, " and ")),
                  absl::StrCat("ZeRO ", zero, " together with ",
                               ep > 1 ? "tensor, pipeline or expert parallelism"
                                      : "tensor or pipeline parallelism"),
                  absl::StrCat("set zero_stage to ", runs.max_zero_with_model_parallel,
                               " (optimizer states sharded over data_parallel), or ",
                               ep > 1 ? "tensor_parallel, pipeline_parallel and expert_parallel"
                                      : "tensor_parallel and pipeline_parallel",
                               " to 1 to keep ZeRO ", zero));
  }
  return absl::OkStatus();
}

absl::Status CheckTrainerRunsLora(const v1::Layout& layout) {
  // Expert parallelism is allowed (the experts' adapters are sharded with the experts), and so is
  // tensor parallelism (adapters split like their base layers, trainer/model/lora.h).
  if (layout.pipeline_parallel() > 1 || layout.zero_stage() > 1) {
    return absl::UnimplementedError(absl::StrCat(
        "parallelism.layout: pipeline_parallel ", layout.pipeline_parallel(), ", zero_stage ",
        layout.zero_stage(),
        " with lora: this trainer runs LoRA under data, tensor and expert parallelism with ZeRO 0 "
        "or 1 (no pipeline stages); set pipeline_parallel to 1 and zero_stage to 0 or 1, or use "
        "parallelism: auto"));
  }
  return absl::OkStatus();
}

absl::StatusOr<JobPlan> PlanJobSpec(const v1::JobSpec& spec, const JobPlanOptions& options) {
  RETURN_IF_ERROR(ValidateDeviceModel(options.device));
  v1::ModelSummary model;
  if (options.model.has_value()) {
    model = *options.model;
  } else {
    ASSIGN_OR_RETURN(model, ResolveModel(spec.model(), spec.data().seq_len()));
  }
  Workload w;
  w.dims = model.dims();
  w.seq_len = spec.data().seq_len();
  w.global_batch = spec.batch().global_batch_size();
  w.lora_rank = options.lora_rank;
  if (w.global_batch <= 0) {
    return Invalid("batch.global_batch_size", absl::StrCat("must be > 0, got ", w.global_batch));
  }
  const int micro = spec.batch().micro_batch_size();
  if (micro < 0) {
    return Invalid("batch.micro_batch_size", absl::StrCat("must be >= 0, got ", micro));
  }
  if (options.lora_rank < 0) {
    return Invalid("lora_rank", absl::StrCat("must be >= 0, got ", options.lora_rank));
  }
  const bool lora = spec.has_lora() && spec.lora().rank() > 0;
  std::optional<ResolvedLora> resolved_lora;
  if (lora) {
    if (options.lora.has_value()) {
      resolved_lora = *options.lora;
    } else {
      ASSIGN_OR_RETURN(resolved_lora, ResolveLora(spec.lora(), model.dims()));
    }
    const ResolvedLora& resolved = *resolved_lora;
    w.lora_rank = resolved.rank;
    w.lora_layer_parameters = resolved.parameters_per_layer;
    w.lora_expert_layer_parameters = ExpertLoraLayerParameters(resolved);
    w.lora_base_nf4 = resolved.base_nf4;
  }
  const bool cpu = IsCpu(options.device);
  switch (spec.precision()) {
    case v1::PRECISION_UNSPECIFIED:
    case v1::PRECISION_FP32:
    case v1::PRECISION_BF16:
      w.precision = ResolvePrecision(spec.precision(), /*gpus=*/!cpu);
      break;
    default:
      return Invalid("precision", absl::StrCat("unknown value ", spec.precision()));
  }
  ClusterShape cluster;
  cluster.device = options.device;
  cluster.gpus = options.devices > 0           ? options.devices
                 : spec.resources().gpus() > 0 ? spec.resources().gpus()
                                               : spec.resources().cpu_slots();
  cluster.gpus_per_node = options.devices_per_node;
  if (cluster.gpus <= 0) {
    return Invalid("resources.gpus", "plan for at least one device (gpus or cpu_slots > 0)");
  }
  if (cluster.gpus_per_node <= 0) {
    return Invalid("devices_per_node", absl::StrCat("must be > 0, got ", cluster.gpus_per_node));
  }

  SearchLimits limits;
  limits.micro_batch = micro;
  const bool explicit_layout = spec.parallelism().has_layout();
  if (!explicit_layout) {
    const v1::AutoLayoutSpec& auto_layout = spec.parallelism().auto_layout();
    limits.max_tp = auto_layout.max_tensor_parallel();
    limits.max_pp = auto_layout.max_pipeline_parallel();
    limits.max_cp = auto_layout.max_context_parallel();
    limits.max_ep = auto_layout.max_expert_parallel();
    limits.max_v = auto_layout.max_pipeline_virtual_stages();
    for (const auto& [name, value] :
         {std::pair<const char*, int>{"max_context_parallel", limits.max_cp},
          {"max_expert_parallel", limits.max_ep},
          {"max_pipeline_virtual_stages", limits.max_v}}) {
      if (value < 0) {
        return Invalid(absl::StrCat("parallelism.auto_layout.", name),
                       absl::StrCat("must be >= 0, got ", value));
      }
    }
    if (auto_layout.has_max_zero_stage()) limits.max_zero = auto_layout.max_zero_stage();
    if (auto_layout.has_allow_activation_checkpointing()) {
      limits.allow_activation_checkpointing = auto_layout.allow_activation_checkpointing();
    }
    const double headroom = auto_layout.memory_headroom_fraction();
    if (headroom < 0 || headroom > 1 || headroom != headroom) {
      return Invalid("parallelism.auto_layout.memory_headroom_fraction",
                     absl::StrCat("must be in (0, 1] (0 for 0.9), got ", headroom));
    }
    if (headroom > 0) cluster.memory_headroom = headroom;
    if (options.runnable_only) {
      const SearchLimits runnable = TrainerCapabilities();
      // 0 is "no limit" for the degrees.
      auto cap = [](int limit, int max) {
        if (max <= 0) return limit;
        return limit > 0 ? std::min(limit, max) : max;
      };
      limits.max_tp = cap(limits.max_tp, runnable.max_tp);
      limits.max_pp = cap(limits.max_pp, runnable.max_pp);
      limits.max_cp = cap(limits.max_cp, runnable.max_cp);
      limits.max_ep = cap(limits.max_ep, runnable.max_ep);
      limits.max_v = cap(limits.max_v, runnable.max_v);
      limits.max_zero = std::min(limits.max_zero, runnable.max_zero);
      limits.max_zero_with_model_parallel =
          std::min(limits.max_zero_with_model_parallel, runnable.max_zero_with_model_parallel);
      limits.allow_activation_checkpointing &= runnable.allow_activation_checkpointing;
      limits.allow_sequence_parallel &= runnable.allow_sequence_parallel;
      limits.context_parallel_with_experts &= runnable.context_parallel_with_experts;
    }
    if (lora && options.runnable_only) {
      // The trainer runs LoRA under data, tensor and expert parallelism with ZeRO 0 or 1
      // (CheckTrainerRunsLora).
      limits.max_pp = 1;
      limits.max_cp = 1;
      limits.max_zero = std::min(limits.max_zero, 1);
    }
  }

  JobPlan out;
  if (explicit_layout) {
    const v1::Layout& layout = spec.parallelism().layout();
    // FromProto reads 0 as 1 for these degrees; a negative one is an error, not a default.
    for (const auto& [name, value] :
         {std::pair<const char*, int>{"context_parallel", layout.context_parallel()},
          {"expert_parallel", layout.expert_parallel()},
          {"pipeline_virtual_stages", layout.pipeline_virtual_stages()}}) {
      if (value < 0) {
        return Invalid(absl::StrCat("parallelism.layout.", name),
                       absl::StrCat("must be >= 0 (0 means 1), got ", value));
      }
    }
    const std::vector<int> micro_batches =
        micro > 0 ? std::vector<int>{micro}
                  : MicroBatchChoices(w.global_batch / std::max(1, layout.data_parallel()));
    SearchResult result;
    for (int m : micro_batches) {
      result.candidates.push_back(EvaluateLayout(w, FromProto(layout, m), cluster));
    }
    RankCandidates(result);
    out.plan = ChoosePlan(result, cluster);
    out.plan.set_explanation(
        absl::StrCat("Explicit layout from the job spec. ", out.plan.explanation()));
    out.candidates = std::move(result.candidates);
  } else {
    SearchResult result = SearchLayouts(w, cluster, limits);
    out.plan = ChoosePlan(result, cluster);
    if (options.runnable_only) {
      out.plan.set_explanation(absl::StrCat(out.plan.explanation(),
                                            " Chosen among the layouts this trainer runs (",
                                            kTrainerRuns, ")."));
    }
    out.candidates = std::move(result.candidates);
  }
  // The resolved model, its preset name included, and the resolved lora.
  *out.plan.mutable_model() = model;
  if (resolved_lora.has_value()) *out.plan.mutable_lora() = ToLoraPlan(*resolved_lora);
  return out;
}

absl::StatusOr<v1::PlanLayoutResponse> PlanLayoutRequest(const v1::PlanLayoutRequest& request,
                                                         const absl::StatusOr<DeviceTarget>& live) {
  if (request.gpus() < 0 || request.gpus_per_node() < 0 || request.max_candidates() < 0 ||
      request.lora_rank() < 0) {
    return absl::InvalidArgumentError(
        "gpus, gpus_per_node, max_candidates and lora_rank must be >= 0");
  }
  DeviceTarget target;
  const std::string preset =
      !request.device().name().empty() ? request.device().name() : request.gpu_type();
  if (!preset.empty()) {
    auto device = DevicePreset(preset);
    if (!device.ok()) device = DeviceForGpuName(preset, 0);
    if (!device.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device: '", preset,
          "' is not a known device; known: ", absl::StrJoin(DevicePresetNames(), ", ")));
    }
    target.device = *std::move(device);
  } else if (live.ok()) {
    target = *live;
  } else {
    return absl::Status(live.status().code(),
                        absl::StrCat(live.status().message(),
                                     "; name a device (gpu_type or device.name) to plan for a "
                                     "hypothetical cluster"));
  }
  target.device = ApplyDeviceOverrides(target.device, request.device());
  JobPlanOptions options;
  options.device = target.device;
  options.devices = request.gpus();
  options.devices_per_node = request.gpus_per_node() > 0   ? request.gpus_per_node()
                             : target.devices_per_node > 0 ? target.devices_per_node
                             : IsCpu(target.device)        ? 1
                                                           : 8;
  options.lora_rank = request.lora_rank();
  ASSIGN_OR_RETURN(JobPlan plan, PlanJobSpec(request.spec(), options));
  v1::PlanLayoutResponse response;
  *response.mutable_plan() = std::move(plan.plan);
  const int limit = request.max_candidates() > 0 ? request.max_candidates() : 10;
  for (auto& candidate : plan.candidates) {
    if (response.candidates_size() >= limit) break;
    *response.add_candidates() = std::move(candidate);
  }
  return response;
}

}  // namespace tessera::planner
