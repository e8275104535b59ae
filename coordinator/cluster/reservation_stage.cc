#include "coordinator/cluster/reservation_stage.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/jobs/attempt_policy.h"
#include "coordinator/nodes/shard_cache_peers.h"
#include "coordinator/scheduling/assignments.h"

namespace tessera::coordinator {
namespace {

// A restart's trainers learn how far the store's step metrics are complete, so that rank 0
// reports again, from the checkpoint it resumes from, the steps whose reports were lost with the
// previous attempt (TrainerTask.metrics_complete_through_step). One read of the job's metric
// steps, without the cluster lock; on an error (logged) the field stays unset and nothing is
// reported again.
void StampMetricsComplete(Store& store, const v1::Job& job,
                          std::map<std::string, v1::TaskAssignment>& assignments) {
  if (job.attempt() == 0) return;
  absl::StatusOr<int64_t> complete = store.MetricsCompleteThrough(job.job_id(), 0);
  if (!complete.ok()) {
    LogRetried(complete.status(), absl::StrCat("reading the metric steps of job ", job.job_id()));
    return;
  }
  for (auto& [node_id, assignment] : assignments) {
    for (v1::TrainerTask& task : *assignment.mutable_trainers()) {
      task.set_metrics_complete_through_step(*complete);
    }
  }
}

// Records the allocation of a placement and queues its orders held back
// (NodeRegistry::ReleaseStart releases them); returns its master port, stored with the placement
// so that a restarted coordinator reserves the same one.
int ReserveOneLocked(GuardedLedger::Hold& held, ClusterState& state, const NodeRegistry& nodes,
                     const v1::Job& job, const v1::JobSpec& spec, const GangPlacement& placement,
                     std::map<std::string, v1::TaskAssignment> assignments) {
  Allocation allocation;
  allocation.attempt = job.attempt();
  allocation.queue = job.queue();
  allocation.priority = spec.priority();
  allocation.ranks = placement.ranks;
  allocation.master_node = placement.ranks.front().node_id();
  allocation.master_port = held->FreeMasterPort(
      allocation.master_node, state.options.base_master_port, /*avoid=*/job.master_port());
  const int master_port = allocation.master_port;
  allocation.placed_time = state.Now();
  allocation.last_checkpoint_time = allocation.placed_time;
  allocation.start_step = StartStep(job, spec);
  allocation.storing = true;
  std::vector<std::string> node_ids;
  for (const auto& [node_id, assignment] : assignments) node_ids.push_back(node_id);
  AssignShardCachePeers(nodes.Addresses(node_ids), assignments);
  for (auto& [node_id, assignment] : assignments) {
    for (v1::TrainerTask& task : *assignment.mutable_trainers()) {
      task.mutable_assignment()->set_master_port(master_port);
    }
    state.orders.QueueStart(node_id, std::move(assignment), /*held=*/true);
  }
  held->Add(job.job_id(), std::move(allocation));
  return master_port;
}

}  // namespace

std::vector<std::map<std::string, v1::TaskAssignment>> MakeAssignments(
    const ClusterState& state, const std::vector<GangPlacement>& placed, const PlacedJobs& jobs) {
  std::vector<std::map<std::string, v1::TaskAssignment>> assignments;
  assignments.reserve(placed.size());
  for (const GangPlacement& placement : placed) {
    const v1::Job& job = *jobs.jobs.at(placement.job_id);
    // Every rank skips the data that the job's rollbacks so far skipped.
    v1::JobSpec task_spec = jobs.specs.at(placement.job_id);
    AddRollbackSkips(job, &task_spec);
    assignments.push_back(PlacementAssignments(
        job, task_spec, placement, jobs.plans.at(placement.job_id), state.options.checkpoint_root));
    StampMetricsComplete(*state.store, job, assignments.back());
  }
  return assignments;
}

Reservation ReserveLocked(GuardedLedger::Hold& held, ClusterState& state, const NodeRegistry& nodes,
                          std::vector<GangPlacement>& placed, uint64_t generation,
                          const PlacedJobs& jobs,
                          std::vector<std::map<std::string, v1::TaskAssignment>> assignments) {
  Reservation reservation;
  for (size_t i = 0; i < placed.size(); ++i) {
    GangPlacement& placement = placed[i];
    bool stale = false;
    for (const auto& rank : placement.ranks) {
      stale = stale || nodes.ChangedSince(rank.node_id(), generation);
    }
    if (stale || held->Find(placement.job_id) != nullptr) continue;
    nodes.IdentifyGpus(placement.ranks);
    reservation.master_ports[placement.job_id] =
        ReserveOneLocked(held, state, nodes, *jobs.jobs.at(placement.job_id),
                         jobs.specs.at(placement.job_id), placement, std::move(assignments[i]));
    reservation.placements.push_back(&placement);
  }
  return reservation;
}

}  // namespace tessera::coordinator
