#include "coordinator/cluster/preemption_stage.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/scheduling/capacity_preemption.h"

namespace tessera::coordinator {

void PreemptionStage::RunLocked(GuardedLedger::Hold& held, ClusterState& state,
                                const PassSnapshot& snapshot,
                                std::vector<QueuedRequest> held_by_quota,
                                const std::vector<GangRequest>& unplaced,
                                const std::map<std::string, std::string>& queue_of,
                                std::map<std::string, std::string>* reasons,
                                std::vector<JobManager::TransitionRequest>* writes) {
  const size_t before = writes->size();
  if (!held_by_quota.empty()) {
    QuotaLocked(held, state, snapshot, std::move(held_by_quota), reasons, writes);
  }
  if (writes->size() == before)
    CapacityLocked(held, state, snapshot, unplaced, queue_of, reasons, writes);
}

void PreemptionStage::QuotaLocked(GuardedLedger::Hold& held, ClusterState& state,
                                  const PassSnapshot& snapshot,
                                  std::vector<QueuedRequest> held_requests,
                                  std::map<std::string, std::string>* reasons,
                                  std::vector<JobManager::TransitionRequest>* writes) {
  if (snapshot.queues == nullptr) return;
  const QueueConfig& config = *snapshot.queues;
  const absl::Time now = state.Now();
  std::vector<RunningJob> running;
  for (const auto& [job_id, allocation] : held->all()) {
    // Victims still saving their checkpoint free nothing yet: decide again once they have.
    if (!allocation.preempted.empty() && allocation.phase() == Allocation::Phase::kMoving) return;
    if (allocation.phase() != Allocation::Phase::kRunning || allocation.storing ||
        allocation.success_pending || allocation.ranks.empty()) {
      continue;
    }
    running.push_back({.job_id = job_id,
                       .queue = CountingQueue(allocation.queue, config),
                       .priority = allocation.priority,
                       .use_gpus = allocation.ranks.front().gpu_index() >= 0,
                       .devices = static_cast<int64_t>(allocation.ranks.size()),
                       .since_checkpoint = now - allocation.last_checkpoint_time});
  }
  std::sort(held_requests.begin(), held_requests.end(),
            [](const QueuedRequest& a, const QueuedRequest& b) {
              return std::tie(b.priority, a.submit_order, a.job_id) <
                     std::tie(a.priority, b.submit_order, b.job_id);
            });
  // Only each queue's head (per resource) may preempt: the later requests of a queue wait
  // behind it anyway (queue_admission.h). So a pass makes at most one search per queue and
  // resource, however many jobs wait: O(queues x running), not O(waiting x running).
  std::set<std::pair<std::string, bool>> heads_tried;
  for (const QueuedRequest& request : held_requests) {
    // A request that can never start under its quota holds nothing back: the next one is head.
    if (QuotaUnsatisfiable(config, request).has_value()) continue;
    if (!heads_tried.emplace(request.queue, request.use_gpus).second) continue;
    const PreemptionDecision decision = SelectPreemption(config, running, request);
    if (decision.victims.empty()) continue;
    VictimsLocked(held, state, request.job_id, absl::StrCat(" of queue ", request.queue), decision,
                  config.preemption_checkpoint_deadline, &config, reasons, writes);
    return;
  }
}

void PreemptionStage::VictimsLocked(GuardedLedger::Hold& held, ClusterState& state,
                                    const std::string& for_job, const std::string& label,
                                    const PreemptionDecision& decision, absl::Duration deadline,
                                    const QueueConfig* config,
                                    std::map<std::string, std::string>* reasons,
                                    std::vector<JobManager::TransitionRequest>* writes) {
  const absl::Time now = state.Now();
  std::vector<std::string> names;
  for (const Victim& victim : decision.victims) {
    Allocation* allocation = held->Find(victim.job_id);
    if (allocation == nullptr) continue;
    allocation->preempted = absl::StrCat("preempted by ", for_job, label, " (", victim.reason, ")");
    allocation->preempted_time = now;
    allocation->preemption_deadline = deadline;
    fate_->MoveLocked(held, victim.job_id, *allocation);
    names.push_back(victim.job_id);
    const std::string queue =
        config != nullptr ? CountingQueue(allocation->queue, *config) : allocation->queue;
    ++preemptions_[queue][PreemptionKindName(victim.kind)];
    // RUNNING (or SCHEDULED) -> PREEMPTED, unless the attempt ended meanwhile: its end, stored
    // by AttemptFate, decides then.
    writes->push_back(
        {victim.job_id, v1::JOB_STATE_PREEMPTED,
         absl::StrCat(allocation->preempted, ": saving a checkpoint (deadline ",
                      absl::FormatDuration(allocation->preemption_deadline), ")"),
         nullptr, [attempt = allocation->attempt, job_id = victim.job_id](const v1::Job& job) {
           if (job.attempt() == attempt &&
               (job.state() == v1::JOB_STATE_SCHEDULED || job.state() == v1::JOB_STATE_RUNNING)) {
             return absl::OkStatus();
           }
           return absl::FailedPreconditionError(
               absl::StrCat("job ", job_id, " no longer runs attempt ", attempt));
         }});
  }
  (*reasons)[for_job] = absl::StrCat("waiting for ", absl::StrJoin(names, ", "),
                                     " to save a checkpoint and stop (", decision.reason, ")");
}

void PreemptionStage::CapacityLocked(GuardedLedger::Hold& held, ClusterState& state,
                                     const PassSnapshot& snapshot,
                                     const std::vector<GangRequest>& unplaced,
                                     const std::map<std::string, std::string>& queues,
                                     std::map<std::string, std::string>* reasons,
                                     std::vector<JobManager::TransitionRequest>* writes) {
  if (unplaced.empty()) return;
  const QueueConfig* config = snapshot.queues.get();
  auto counting = [config](const std::string& queue) {
    return config != nullptr ? CountingQueue(queue, *config) : queue;
  };
  // Only jobs of a lower priority than the highest waiting one can be preempted: with equal
  // priorities (the common case) nothing below is built, however many jobs run.
  int highest = unplaced.front().priority;
  for (const GangRequest& request : unplaced) highest = std::max(highest, request.priority);
  const absl::Time now = state.Now();
  std::vector<RunningGang> running;
  for (const auto& [job_id, allocation] : held->all()) {
    // Victims still saving their checkpoint free nothing yet: decide again once they have.
    if (!allocation.preempted.empty() && allocation.phase() == Allocation::Phase::kMoving) return;
    if (allocation.priority >= highest || allocation.phase() != Allocation::Phase::kRunning ||
        allocation.storing || allocation.success_pending || allocation.ranks.empty()) {
      continue;
    }
    running.push_back({.job = {.job_id = job_id,
                               .queue = counting(allocation.queue),
                               .priority = allocation.priority,
                               .use_gpus = allocation.ranks.front().gpu_index() >= 0,
                               .devices = static_cast<int64_t>(allocation.ranks.size()),
                               .since_checkpoint = now - allocation.last_checkpoint_time},
                       .ranks = &allocation.ranks});
  }
  if (running.empty()) return;
  const std::vector<NodeCapacity> capacity =
      NodeRegistry::Subtract(*nodes_->Summaries().summaries, held->Used());
  // The highest priority first, one decision per pass (its victims stop before the next).
  std::vector<const GangRequest*> order;
  for (const GangRequest& request : unplaced) order.push_back(&request);
  std::sort(order.begin(), order.end(), [](const GangRequest* a, const GangRequest* b) {
    return std::tie(b->priority, a->submit_order, a->job_id) <
           std::tie(a->priority, b->submit_order, b->job_id);
  });
  // Only each queue's highest request (per resource) may preempt, as for quota: the others wait
  // behind it anyway. At most one search per queue and resource.
  std::set<std::pair<std::string, bool>> heads_tried;
  for (const GangRequest* request : order) {
    const auto queue = queues.find(request->job_id);
    if (queue == queues.end()) continue;
    const std::string label = counting(queue->second);
    if (!heads_tried.emplace(label, request->use_gpus).second) continue;
    const PreemptionDecision decision =
        SelectCapacityPreemption(running, *request, label, capacity);
    if (decision.victims.empty()) continue;
    VictimsLocked(held, state, request->job_id, absl::StrCat(" of queue ", label), decision,
                  config != nullptr ? config->preemption_checkpoint_deadline
                                    : kDefaultPreemptionCheckpointDeadline,
                  config, reasons, writes);
    return;
  }
}

}  // namespace tessera::coordinator
