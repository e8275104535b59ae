#include "coordinator/admission/layout_planning.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "planner/devices.h"
#include "planner/job_plan.h"
#include "planner/lora.h"
#include "planner/model_config.h"
#include "planner/training_settings.h"

namespace tessera::coordinator {
namespace {

bool Matches(const v1::JobSpec& spec, const NodeCapacity& node, bool gpus) {
  if (!node.schedulable) return false;
  for (const auto& [key, value] : spec.resources().node_selector()) {
    auto it = node.labels.find(key);
    if (it == node.labels.end() || it->second != value) return false;
  }
  if (!gpus) return node.total_cpu_slots > 0;
  return node.total_gpus > 0 && absl::StrContains(node.gpu_name, spec.resources().gpu_type());
}

}  // namespace

absl::StatusOr<planner::DeviceTarget> TargetFromNodes(const v1::JobSpec& spec,
                                                      const std::vector<NodeCapacity>& nodes) {
  const bool gpus = spec.resources().gpus() > 0;
  // Per GPU name (or "" for CPU slots): free devices, total devices, largest node, memory.
  struct Group {
    int free = 0, total = 0, largest = 0;
    int64_t memory = 0;
  };
  std::map<std::string, Group> groups;
  for (const NodeCapacity& node : nodes) {
    if (!Matches(spec, node, gpus)) continue;
    Group& g = groups[gpus ? node.gpu_name : ""];
    const int total = gpus ? node.total_gpus : node.total_cpu_slots;
    g.free += gpus ? static_cast<int>(node.free_gpus.size()) : node.free_cpu_slots;
    g.total += total;
    g.largest = std::max(g.largest, total);
    // A CPU slot's share of its host's memory; for GPUs the device's own.
    const int64_t memory = gpus ? node.gpu_memory_bytes
                           : node.total_cpu_slots > 0
                               ? node.host_memory_bytes / node.total_cpu_slots
                               : 0;
    g.memory = std::max(g.memory, memory);
  }
  if (groups.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no registered node offers ", gpus ? "GPUs" : "CPU slots",
        spec.resources().gpu_type().empty()
            ? ""
            : absl::StrCat(" of type '", spec.resources().gpu_type(), "'"),
        spec.resources().node_selector().empty() ? "" : " with the job's node_selector labels"));
  }
  auto best = std::max_element(groups.begin(), groups.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(a.second.free, a.second.total, b.first) <
           std::make_tuple(b.second.free, b.second.total, a.first);
  });
  planner::DeviceTarget target;
  target.gpu_name = best->first;
  target.devices_per_node = best->second.largest;
  ASSIGN_OR_RETURN(target.device, planner::DeviceForGpuName(best->first, best->second.memory));
  return target;
}

absl::StatusOr<v1::PlanLayoutResponse> PlanLayoutFor(const v1::PlanLayoutRequest& request,
                                                     const std::vector<NodeCapacity>& nodes) {
  return planner::PlanLayoutRequest(request, TargetFromNodes(request.spec(), nodes));
}

absl::StatusOr<v1::LayoutPlan> PlanForTarget(const v1::JobSpec& spec,
                                             const v1::LayoutPlan& submitted,
                                             const absl::StatusOr<planner::DeviceTarget>& target) {
  if (!target.ok()) return target.status();
  planner::JobPlanOptions options;
  options.device = target->device;
  options.devices_per_node = std::max(1, target->devices_per_node);
  options.runnable_only = true;
  // Plans stored before the model was resolved at submission have no dimensions.
  if (submitted.model().dims().hidden_size() > 0) options.model = submitted.model();
  if (submitted.has_lora()) options.lora = planner::FromLoraPlan(submitted.lora());
  ASSIGN_OR_RETURN(planner::JobPlan plan, planner::PlanJobSpec(spec, options));
  if (submitted.has_settings()) *plan.plan.mutable_settings() = submitted.settings();
  if (!target->gpu_name.empty()) {
    plan.plan.set_explanation(
        absl::StrCat(plan.plan.explanation(), " Planned for ", target->gpu_name, "."));
  }
  return CompletePlan(spec, std::move(plan.plan));
}

v1::LayoutPlan CompletePlan(const v1::JobSpec& spec, v1::LayoutPlan plan) {
  if (plan.model().dims().hidden_size() == 0) {
    // Submission resolved this spec's model once; an error here (a from_pretrained directory
    // gone since) leaves the plan without one, and the trainer says so.
    if (auto model = planner::ResolveModel(spec.model(), spec.data().seq_len()); model.ok()) {
      *plan.mutable_model() = *std::move(model);
    }
  }
  if (!planner::HasTrainingSettings(plan)) {
    *plan.mutable_settings() = planner::ResolveTrainingSettings(spec);
  }
  if (plan.precision() == v1::PRECISION_UNSPECIFIED) {
    plan.set_precision(planner::ResolvePrecision(spec.precision(), spec.resources().gpus() > 0));
  }
  if (spec.has_lora() && !plan.has_lora() && plan.model().dims().hidden_size() > 0) {
    if (auto lora = planner::ResolveLora(spec.lora(), plan.model().dims()); lora.ok()) {
      *plan.mutable_lora() = planner::ToLoraPlan(*lora);
    }
  }
  return plan;
}

}  // namespace tessera::coordinator
