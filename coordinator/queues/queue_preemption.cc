#include "coordinator/queues/queue_preemption.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace tessera::coordinator {

bool VictimBefore(const RunningJob& a, const RunningJob& b) {
  return std::make_tuple(a.priority, a.since_checkpoint, -a.devices, a.job_id) <
         std::make_tuple(b.priority, b.since_checkpoint, -b.devices, b.job_id);
}

std::string DescribeVictim(const RunningJob& job) {
  return absl::StrCat("priority ", job.priority, ", ", absl::FormatDuration(job.since_checkpoint),
                      " since its last checkpoint");
}

PreemptionDecision SelectPreemption(const QueueConfig& config,
                                    const std::vector<RunningJob>& running,
                                    const QueuedRequest& waiting) {
  PreemptionDecision decision;
  if (config.implicit()) {
    decision.reason = "no queues are configured: there is no quota to preempt for";
    return decision;
  }
  const QueueSpec* queue = config.Find(waiting.queue);
  if (queue == nullptr) {
    decision.reason = absl::StrCat("queue ", waiting.queue, " is not configured");
    return decision;
  }
  if (std::optional<std::string> never = QuotaUnsatisfiable(config, waiting)) {
    decision.reason = absl::StrCat(*never, ": preemption cannot help");
    return decision;
  }
  const ResourceKind kind = waiting.use_gpus ? ResourceKind::kGpus : ResourceKind::kCpuSlots;
  const absl::string_view unit = ResourceName(kind);
  std::map<std::string, Resources> in_use;
  std::vector<const RunningJob*> same_kind;
  for (const RunningJob& job : running) {
    Get(in_use[job.queue], job.use_gpus ? ResourceKind::kGpus : ResourceKind::kCpuSlots) +=
        job.devices;
    if (job.use_gpus == waiting.use_gpus) same_kind.push_back(&job);
  }
  std::sort(same_kind.begin(), same_kind.end(),
            [](const RunningJob* a, const RunningJob* b) { return VictimBefore(*a, *b); });
  const QuotaLedger before(config, in_use);
  std::optional<std::string> why = before.WhyNotFit(*queue, kind, waiting.devices);
  if (!why.has_value()) {
    decision.reason = absl::StrCat(waiting.job_id, " fits its queue's quota: nothing to preempt");
    return decision;
  }
  std::string reclaim_failure;
  // Reclaim borrowed quota for a queue below its nominal.
  const int64_t nominal = Get(queue->nominal, kind);
  if (!queue->cohort.empty() && before.Used(*queue, kind) + waiting.devices <= nominal) {
    QuotaLedger ledger = before;
    std::vector<Victim> victims;
    for (const RunningJob* job : same_kind) {
      if (!ledger.WhyNotFit(*queue, kind, waiting.devices).has_value()) break;
      const QueueSpec* owner = config.Find(job->queue);
      if (owner == nullptr || owner == queue || owner->cohort != queue->cohort) continue;
      const int64_t borrowed = ledger.Borrowed(*owner, kind);
      if (borrowed <= 0) continue;
      victims.push_back({job->job_id, PreemptionKind::kReclaim,
                         absl::StrCat("reclaimed for queue ", queue->name, " (below its nominal ",
                                      nominal, " ", unit, ", ", waiting.job_id, " needs ",
                                      waiting.devices, "): queue ", owner->name, " borrows ",
                                      borrowed, " ", unit, "; ", DescribeVictim(*job))});
      ledger.Add(*owner, kind, -job->devices);
    }
    if (!ledger.WhyNotFit(*queue, kind, waiting.devices).has_value()) {
      decision.victims = std::move(victims);
      decision.reason =
          absl::StrCat("reclaim ", decision.victims.size(), " job(s) borrowing from ",
                       QuotaLedger::CohortLabel(*queue), " for ", waiting.job_id, " (", *why, ")");
      return decision;
    }
    reclaim_failure = absl::StrCat("reclaiming every borrowing job of ",
                                   QuotaLedger::CohortLabel(*queue), " would not free enough");
  }
  // Lower priorities of the same queue.
  QuotaLedger ledger = before;
  std::vector<Victim> victims;
  for (const RunningJob* job : same_kind) {
    if (!ledger.WhyNotFit(*queue, kind, waiting.devices).has_value()) break;
    if (job->queue != queue->name || job->priority >= waiting.priority) continue;
    victims.push_back(
        {job->job_id, PreemptionKind::kPriority,
         absl::StrCat("preempted by higher-priority ", waiting.job_id, " (priority ",
                      waiting.priority, ") in queue ", queue->name, "; ", DescribeVictim(*job))});
    ledger.Add(*queue, kind, -job->devices);
  }
  if (!ledger.WhyNotFit(*queue, kind, waiting.devices).has_value()) {
    decision.victims = std::move(victims);
    decision.reason =
        absl::StrCat("preempt ", decision.victims.size(), " lower-priority job(s) of queue ",
                     queue->name, " for ", waiting.job_id, " (", *why, ")");
    return decision;
  }
  decision.reason = absl::StrCat(
      "nothing to preempt for ", waiting.job_id, " (", *why,
      "): ", reclaim_failure.empty() ? "" : absl::StrCat(reclaim_failure, ", and "),
      "preempting every lower-priority job of queue ", queue->name, " would not free enough");
  return decision;
}

const char* PreemptionKindName(PreemptionKind kind) {
  return kind == PreemptionKind::kReclaim ? "reclaim" : "priority";
}

}  // namespace tessera::coordinator
