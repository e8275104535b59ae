// Where the coordinator meets the layout planner (planner/job_plan.h): the device and node shape of
// the live cluster a job would run on, for the PlanLayout RPC and for scheduling. Pure functions
// over NodeCapacity lists, so the scheduler's lock is the only synchronisation needed; thread-safe.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/scheduler.h"
#include "planner/job_plan.h"
#include "tessera/v1/coordinator_service.pb.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::coordinator {

// The device and node shape of the live cluster for `spec`: among schedulable nodes that match its
// node_selector (and gpu_type), for GPU jobs the GPU model with the most free GPUs (ties: most in
// total, then name), for CPU jobs the CPU slot model with the host's memory shared among its slots
// (unchecked when a node registered none). devices_per_node is the largest such node.
// FAILED_PRECONDITION when no registered node matches; NOT_FOUND when the GPU has no device model.
absl::StatusOr<planner::DeviceTarget> TargetFromNodes(const v1::JobSpec& spec,
                                                      const std::vector<NodeCapacity>& nodes);

// Coordinator.PlanLayout on the live cluster `nodes` (see planner::PlanLayoutRequest).
absl::StatusOr<v1::PlanLayoutResponse> PlanLayoutFor(const v1::PlanLayoutRequest& request,
                                                     const std::vector<NodeCapacity>& nodes);

// The plan a pending job runs with on `target` (TargetFromNodes of the nodes registered now): an
// automatic layout is chosen among those the trainer runs, an explicit one is checked. The
// result's `fits` is false (and its explanation is the pending reason) when nothing fits; an error
// when the job cannot be planned there at all (no matching node, unknown GPU model; `target`'s
// error is returned as is) - the caller then keeps the job's provisional plan. `submitted` is the
// plan made at submission (JobManager, PlanJob): its resolved model is planned for rather than
// resolving the spec again, and its training settings are carried into the result.
absl::StatusOr<v1::LayoutPlan> PlanForTarget(const v1::JobSpec& spec,
                                             const v1::LayoutPlan& submitted,
                                             const absl::StatusOr<planner::DeviceTarget>& target);

// `plan` with what a trainer needs of it and a plan stored by an older coordinator may lack,
// resolved from `spec` as a submission resolves it now (ResolveJob): the model for the spec's
// sequence length, the training settings, the precision and the lora. What `plan` has is kept. The
// trainer takes these from the plan only: the coordinator is where a spec is resolved.
v1::LayoutPlan CompletePlan(const v1::JobSpec& spec, v1::LayoutPlan plan);

}  // namespace tessera::coordinator
