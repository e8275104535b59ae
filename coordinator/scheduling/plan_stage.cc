#include "coordinator/scheduling/plan_stage.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/admission/layout_planning.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

bool AutomaticLayout(const v1::JobSpec& spec) { return !spec.parallelism().has_layout(); }

GangRequest RequestFor(const v1::Job& job) {
  const v1::ResourceRequest& resources = job.spec().resources();
  GangRequest request;
  request.job_id = job.job_id();
  request.priority = job.spec().priority();
  request.submit_order =
      google::protobuf::util::TimeUtil::TimestampToNanoseconds(job.create_time());
  request.use_gpus = resources.gpus() > 0;
  request.gpu_type = resources.gpu_type();
  request.node_selector.insert(resources.node_selector().begin(), resources.node_selector().end());
  const v1::PlacementSpec& placement = job.spec().placement();
  request.placement_required = !placement.required().empty();
  request.placement_level =
      request.placement_required ? placement.required() : placement.preferred();
  return request;
}

}  // namespace

v1::JobSpec PlanStage::WithDevices(v1::JobSpec spec, int devices) {
  if (spec.resources().gpus() > 0) {
    spec.mutable_resources()->set_gpus(devices);
  } else {
    spec.mutable_resources()->set_cpu_slots(devices);
  }
  return spec;
}

int PlanStage::RequestedDevices(const v1::JobSpec& spec) {
  return spec.resources().gpus() > 0 ? spec.resources().gpus() : spec.resources().cpu_slots();
}

PlannedJobs PlanStage::Run(const std::vector<v1::Job>& listed, const std::set<std::string>& waiting,
                           const std::vector<NodeCapacity>& capacity) {
  PlannedJobs out;
  // Jobs asking for the same kind of device share one look over the nodes.
  std::map<std::string, absl::StatusOr<planner::DeviceTarget>> targets;
  for (const v1::Job& job : listed) {
    if (!waiting.contains(job.job_id())) continue;
    GangRequest request = RequestFor(job);
    const std::string key = NodeKindKey(request);
    auto target = targets.find(key);
    if (target == targets.end()) {
      target = targets.emplace(key, TargetFromNodes(job.spec(), capacity)).first;
    }
    // A restarting job with an automatic layout that lost devices (a node is gone) runs on what
    // is free rather than waiting for the node: fewer data-parallel replicas, the same global
    // batch through more accumulation. Its checkpoint is resharded on load.
    v1::JobSpec& spec = out.specs[job.job_id()] = job.spec();
    if (job.state() == v1::JOB_STATE_RESTARTING && AutomaticLayout(spec)) {
      int free = 0;
      for (const NodeCapacity& node : capacity) {
        if (!node.schedulable) continue;
        if (!Unsatisfiable(request, {node}).has_value()) {
          free += request.use_gpus ? static_cast<int>(node.free_gpus.size()) : node.free_cpu_slots;
        }
      }
      const int asked = RequestedDevices(spec);
      for (int devices = std::min(free, asked); devices >= 1 && devices < asked; --devices) {
        const v1::JobSpec smaller = WithDevices(job.spec(), devices);
        if (auto plan = PlanForTarget(smaller, job.plan(), target->second);
            plan.ok() && plan->fits()) {
          spec = smaller;
          break;
        }
      }
    }
    // Automatic layouts are chosen for the devices the job would get; explicit ones are checked
    // against them. A job that cannot be planned here (no matching node yet, a GPU without a
    // device model) keeps its provisional plan and the scheduler says why it waits.
    v1::LayoutPlan& plan = out.plans[job.job_id()];
    plan = CompletePlan(spec, job.plan());
    const absl::StatusOr<v1::LayoutPlan>& fitted = Cached(job, spec, target->second);
    if (fitted.ok()) {
      if (!fitted->fits()) {
        out.unfit[job.job_id()] = fitted->explanation();
        continue;
      }
      plan = *fitted;
    }
    out.jobs[job.job_id()] = &job;
    request.world_size = std::max(1, plan.world_size());
    request.tensor_parallel = std::max(1, plan.layout().tensor_parallel());
    out.requests.push_back(std::move(request));
  }
  // Plans of jobs that left the queue are not needed again.
  std::erase_if(cache_, [&](const auto& entry) { return !waiting.contains(entry.first); });
  return out;
}

const absl::StatusOr<v1::LayoutPlan>& PlanStage::Cached(
    const v1::Job& job, const v1::JobSpec& spec,
    const absl::StatusOr<planner::DeviceTarget>& target) {
  // A job's spec never changes, so its plan changes only with the device it is planned for (or
  // the devices it is given after losing some).
  const std::string fingerprint =
      target.ok() ? absl::StrCat(target->device.SerializeAsString(), "|", target->devices_per_node,
                                 "|", target->gpu_name, "|", RequestedDevices(spec))
                  : target.status().ToString();
  Entry& cached = cache_[job.job_id()];
  if (!cached.plan.has_value() || cached.fingerprint != fingerprint) {
    cached.fingerprint = fingerprint;
    cached.plan = PlanForTarget(spec, job.plan(), target);
    ++plans_made_;
  }
  return *cached.plan;
}

}  // namespace tessera::coordinator
