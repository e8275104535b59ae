#include "coordinator/scheduling/assignments.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/scheduling/plan_stage.h"

namespace tessera::coordinator {
namespace {

bool ResumesFromCheckpoints(const v1::JobSpec& spec) {
  return !spec.checkpoint().has_resume() || spec.checkpoint().resume();
}

}  // namespace

std::string TaskId(const std::string& job_id, int32_t attempt, const std::string& node) {
  return absl::StrCat(job_id, "/", attempt, "/", node);
}

int64_t StartStep(const v1::Job& job, const v1::JobSpec& spec) {
  return ResumesFromCheckpoints(spec) ? job.latest_checkpoint().step() : 0;
}

std::map<std::string, v1::TaskAssignment> PlacementAssignments(const v1::Job& job,
                                                               const v1::JobSpec& spec,
                                                               const GangPlacement& placement,
                                                               const v1::LayoutPlan& plan,
                                                               const std::string& checkpoint_root) {
  std::map<std::string, int> local_world;
  for (const auto& rank : placement.ranks) ++local_world[rank.node_id()];
  const std::string checkpoint_dir = spec.checkpoint().directory().empty()
                                         ? absl::StrCat(checkpoint_root, "/", job.job_id())
                                         : spec.checkpoint().directory();
  std::map<std::string, v1::TaskAssignment> assignments;
  for (const auto& rank : placement.ranks) {
    v1::TaskAssignment& assignment = assignments[rank.node_id()];
    assignment.set_task_id(TaskId(job.job_id(), job.attempt(), rank.node_id()));
    v1::TrainerTask* task = assignment.add_trainers();
    task->set_job_id(job.job_id());
    task->set_attempt(job.attempt());
    *task->mutable_spec() = spec;
    *task->mutable_plan() = plan;
    task->set_checkpoint_directory(checkpoint_dir);
    // A collective blocked on a peer that cannot be reached (a partition: its heartbeats go on)
    // fails after the job's hang timeout, as a rank whose heartbeat stops does.
    task->set_collective_timeout_seconds(
        spec.hang_timeout_seconds() > 0 ? spec.hang_timeout_seconds() : kDefaultHangTimeoutSeconds);
    v1::RankAssignment* ra = task->mutable_assignment();
    ra->set_rank(rank.rank());
    ra->set_world_size(static_cast<int>(placement.ranks.size()));
    ra->set_local_rank(rank.local_rank());
    ra->set_local_world_size(local_world[rank.node_id()]);
    ra->set_master_addr(placement.master_addr);
    if (auto host = placement.node_hosts.find(rank.node_id()); host != placement.node_hosts.end()) {
      ra->set_node_addr(host->second);
    }
    ra->set_device_type(rank.gpu_index() >= 0 ? v1::DEVICE_TYPE_CUDA : v1::DEVICE_TYPE_CPU);
    ra->set_gpu_index(rank.gpu_index());
  }
  return assignments;
}

std::string PlacementReason(const v1::Job& job, const v1::JobSpec& spec,
                            const GangPlacement& placement, const v1::LayoutPlan& plan) {
  std::vector<std::string> node_order;
  for (const auto& rank : placement.ranks) {
    if (std::find(node_order.begin(), node_order.end(), rank.node_id()) == node_order.end()) {
      node_order.push_back(rank.node_id());
    }
  }
  std::string reason = absl::StrCat("placed on ", absl::StrJoin(node_order, ", "));
  if (job.attempt() > 0) {
    const int64_t start_step = StartStep(job, spec);
    reason = absl::StrCat("attempt ", job.attempt(), " ", reason, ", resuming from ",
                          start_step > 0 ? absl::StrCat("the checkpoint of step ", start_step)
                                         : std::string("the start"));
    const int asked = PlanStage::RequestedDevices(job.spec());
    if (static_cast<int>(placement.ranks.size()) != asked) {
      absl::StrAppend(&reason, "; re-planned for ", placement.ranks.size(), " of the ", asked,
                      " devices asked for (",
                      plan.explanation().substr(0, plan.explanation().find('.')), ")");
    }
  }
  return reason;
}

}  // namespace tessera::coordinator
