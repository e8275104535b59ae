// WorkerAgent and the leading coordinator (the HA contract, docs/coordinator.md): the leader
// epochs it has seen, whether the leader answers, and what the worker does once none has answered
// for its coordinator grace. The calls themselves fail over in LeaderChannel.
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "worker/worker_agent.h"

namespace tessera::worker {

// The orders a heartbeat answer carries, for the log line of an ignored one; empty when none.
std::string DescribeLeaderOrders(const v1::HeartbeatResponse& response) {
  std::vector<std::string> orders;
  for (const auto& assignment : response.start()) {
    orders.push_back(absl::StrCat("start ", assignment.task_id()));
  }
  for (const auto& id : response.stop()) orders.push_back(absl::StrCat("stop ", id));
  for (const auto& id : response.checkpoint_and_stop()) {
    orders.push_back(absl::StrCat("checkpoint and stop ", id));
  }
  return absl::StrJoin(orders, ", ");
}

grpc::Status WorkerAgent::RefuseDeposedLeader(int64_t epoch, const std::string& address,
                                              const std::string& orders) {
  absl::MutexLock lock(&mu_);
  if (!leader_epoch_ || epoch >= *leader_epoch_) return grpc::Status::OK;
  const std::string why =
      absl::StrCat("coordinator at ", address, " answered with leader epoch ", epoch,
                   ", below the highest seen (", *leader_epoch_, "): a deposed leader");
  if (!orders.empty()) {
    std::cerr << "tessera-worker: ignoring the orders of " << why << ": " << orders << std::endl;
  }
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, why);
}

void WorkerAgent::LeaderAnsweredLocked(bool answered) {
  if (answered) {
    if (!leader_answering_ && clock_->Now() - leader_answered_ >= options_.coordinator_grace) {
      std::cerr << "tessera-worker: the leader answers again at " << leader_->leader() << " after "
                << absl::FormatDuration(clock_->Now() - leader_answered_) << std::endl;
    }
    leader_answered_ = clock_->Now();
  }
  leader_answering_ = answered;
}

void WorkerAgent::EnforceCoordinatorGraceLocked(absl::Time now) {
  if (leader_answering_) return;
  const absl::Duration without = now - leader_answered_;
  if (without < options_.coordinator_grace) return;
  for (auto& [id, task] : tasks_) {
    const bool unlaunched = task.lifecycle.unlaunched();
    if (unlaunched ? !task.lifecycle.StopOrdered()
                   : !task.lifecycle.CheckpointOrdered(now + options_.checkpoint_grace)) {
      continue;
    }
    if (!unlaunched) SignalCheckpointLocked(task);
    std::cerr << "tessera-worker: no coordinator has answered as leader for "
              << absl::FormatDuration(without) << " (coordinator grace "
              << absl::FormatDuration(options_.coordinator_grace) << "): task " << id << ": "
              << (unlaunched ? "not started"
                             : absl::StrCat("asked its ranks to save a checkpoint and stop (up to ",
                                            absl::FormatDuration(options_.checkpoint_grace), ")"))
              << "; its end is reported when a leader answers" << std::endl;
  }
}

CoordinatorContact WorkerAgent::Contact() {
  absl::MutexLock lock(&mu_);
  CoordinatorContact contact;
  contact.reachable = leader_answering_;
  if (!leader_answering_) contact.without = clock_->Now() - leader_answered_;
  contact.leader_epoch = leader_epoch_.value_or(-1);
  return contact;
}

}  // namespace tessera::worker
