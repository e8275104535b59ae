#include "coordinator/cluster/store_stage.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/queues/queue_config.h"
#include "coordinator/scheduling/assignments.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using google::protobuf::util::TimeUtil;

double SecondsSince(absl::Time now, const google::protobuf::Timestamp& time) {
  return absl::ToDoubleSeconds(now - absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(time)));
}

}  // namespace

JobManager::TransitionRequest PlacementWrite(const v1::Job& job, const v1::JobSpec& spec,
                                             const GangPlacement& placement, v1::LayoutPlan plan,
                                             int master_port) {
  std::string reason = PlacementReason(job, spec, placement, plan);
  return {job.job_id(), v1::JOB_STATE_SCHEDULED, std::move(reason),
          [plan = std::move(plan), ranks = placement.ranks, master_port](v1::Job& stored) {
            *stored.mutable_plan() = plan;
            stored.mutable_placements()->Clear();
            for (const auto& rank : ranks) *stored.add_placements() = rank;
            stored.set_master_port(master_port);
          },
          nullptr};
}

std::set<std::string> StoreStage::Store(PassWrites pass) {
  std::set<std::string> placed;
  if (pass.writes.empty()) return placed;
  const std::vector<absl::StatusOr<v1::Job>> stored = jobs_->TransitionAll(pass.writes);
  std::function<void(double)> latency_observer;
  std::function<void(const std::string&, double)> queue_wait_observer;
  {
    absl::MutexLock lock(&observers_mu_);
    latency_observer = latency_observer_;
    queue_wait_observer = queue_wait_observer_;
  }
  std::vector<double> latencies;
  // Each job placed: its queue and the seconds it waited there (only for an observer).
  std::vector<std::pair<std::string, double>> queue_waits;
  std::shared_ptr<const QueueConfig> queues =
      pass.placements > 0 && queue_wait_observer && state_->options.queues != nullptr
          ? state_->options.queues->Current()
          : nullptr;
  {
    GuardedLedger::Hold held(ledger_);
    const absl::Time now = state_->Now();
    for (size_t i = 0; i < pass.placements; ++i) {
      const std::string& job_id = pass.writes[i].job_id;
      Allocation* allocation = held->Find(job_id);
      if (allocation != nullptr) allocation->storing = false;
      if (stored[i].ok()) {
        if (allocation != nullptr) {
          for (const auto& node : allocation->Nodes()) {
            state_->orders.ReleaseStart(node, TaskId(job_id, allocation->attempt, node));
          }
        }
        placed.insert(job_id);
        if (latency_observer && stored[i]->attempt() == 0) {
          latencies.push_back(SecondsSince(now, stored[i]->create_time()));
        }
        if (queue_wait_observer) {
          // Attempt 0 entered its queue at submission, a later one when the previous ended.
          const google::protobuf::Timestamp& entered =
              stored[i]->attempts().empty() ? stored[i]->create_time()
                                            : stored[i]->attempts().rbegin()->end_time();
          queue_waits.emplace_back(queues != nullptr ? CountingQueue(stored[i]->queue(), *queues)
                                                     : std::string(kImplicitQueue),
                                   std::max(0.0, SecondsSince(now, entered)));
        }
        continue;
      }
      // Cancelled meanwhile (FAILED_PRECONDITION), or a store error: nothing was delivered (the
      // orders were held back), so the gang is taken back and a later pass decides.
      if (!absl::IsFailedPrecondition(stored[i].status())) {
        LogRetried(stored[i].status(), absl::StrCat("placing job ", job_id));
      }
      if (allocation != nullptr) {
        for (const auto& node : allocation->Nodes()) {
          state_->orders.WithdrawStart(node, TaskId(job_id, allocation->attempt, node));
        }
        held->Erase(job_id);
      }
    }
  }
  if (latency_observer) {
    for (double seconds : latencies) latency_observer(seconds);
  }
  if (queue_wait_observer) {
    for (const auto& [queue, seconds] : queue_waits) queue_wait_observer(queue, seconds);
  }
  for (size_t i = pass.placements; i < pass.writes.size(); ++i) {
    if (!stored[i].ok() && !absl::IsFailedPrecondition(stored[i].status())) {
      LogRetried(stored[i].status(),
                 absl::StrCat("recording why job ", pass.writes[i].job_id, " waits"));
    }
  }
  return placed;
}

void StoreStage::SetSchedulingLatencyObserver(std::function<void(double)> observer) {
  absl::MutexLock lock(&observers_mu_);
  latency_observer_ = std::move(observer);
}

void StoreStage::SetQueueWaitObserver(
    std::function<void(const std::string& queue, double seconds)> observer) {
  absl::MutexLock lock(&observers_mu_);
  queue_wait_observer_ = std::move(observer);
}

}  // namespace tessera::coordinator
