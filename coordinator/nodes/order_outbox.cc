#include "coordinator/nodes/order_outbox.h"

#include <algorithm>
#include <utility>

namespace tessera::coordinator {

void OrderOutbox::Known(const std::string& node_id, bool lost) {
  absl::MutexLock lock(&mu_);
  Orders& orders = nodes_[node_id];
  orders.lost = lost;
  if (lost) orders = Orders{.lost = true};
}

void OrderOutbox::Lost(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  if (auto it = nodes_.find(node_id); it != nodes_.end()) it->second = Orders{.lost = true};
}

void OrderOutbox::Forget(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  nodes_.erase(node_id);
}

void OrderOutbox::AnnounceLocked(const std::string& node_id) {
  if (notifier_ != nullptr && node_id != answering_) notifier_->Notify(node_id);
}

void OrderOutbox::QueueStart(const std::string& node_id, v1::TaskAssignment assignment, bool held) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  it->second.to_start.push_back({std::move(assignment), held});
  if (!held) AnnounceLocked(node_id);
}

bool OrderOutbox::ReleaseStart(const std::string& node_id, const std::string& task_id) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return false;
  for (Start& start : it->second.to_start) {
    if (start.assignment.task_id() != task_id) continue;
    if (start.held) {
      start.held = false;
      AnnounceLocked(node_id);
    }
    return true;
  }
  return false;
}

bool OrderOutbox::WithdrawStart(const std::string& node_id, const std::string& task_id) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return false;
  return std::erase_if(it->second.to_start, [&](const Start& start) {
           return start.assignment.task_id() == task_id;
         }) > 0;
}

bool OrderOutbox::StartQueued(const std::string& node_id, const std::string& task_id) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return false;
  return std::any_of(it->second.to_start.begin(), it->second.to_start.end(),
                     [&](const Start& start) { return start.assignment.task_id() == task_id; });
}

void OrderOutbox::QueueStop(const std::string& node_id, const std::string& task_id) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || it->second.lost) return;
  std::vector<std::string>& stops = it->second.to_stop;
  if (std::find(stops.begin(), stops.end(), task_id) != stops.end()) return;
  stops.push_back(task_id);
  AnnounceLocked(node_id);
}

void OrderOutbox::QueueCheckpointAndStop(const std::string& node_id, const std::string& task_id,
                                         std::optional<absl::Duration> deadline) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end() || it->second.lost) return;
  std::vector<std::string>& orders = it->second.to_checkpoint_and_stop;
  if (std::find(orders.begin(), orders.end(), task_id) != orders.end()) return;
  orders.push_back(task_id);
  if (deadline) it->second.checkpoint_deadlines[task_id] = *deadline;
  AnnounceLocked(node_id);
}

void OrderOutbox::TakeOrders(const std::string& node_id, v1::HeartbeatResponse* response) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  Orders& orders = it->second;
  for (Start& start : orders.to_start) {
    if (!start.held) *response->add_start() = std::move(start.assignment);
  }
  std::erase_if(orders.to_start, [](const Start& start) { return !start.held; });
  for (std::string& stop : orders.to_stop) response->add_stop(std::move(stop));
  orders.to_stop.clear();
  for (std::string& order : orders.to_checkpoint_and_stop) {
    response->add_checkpoint_and_stop(std::move(order));
  }
  for (const auto& [task_id, deadline] : orders.checkpoint_deadlines) {
    (*response->mutable_checkpoint_deadline_seconds())[task_id] = absl::ToDoubleSeconds(deadline);
  }
  orders.to_checkpoint_and_stop.clear();
  orders.checkpoint_deadlines.clear();
}

void OrderOutbox::SetNotifier(AssignmentNotifier* notifier) {
  absl::MutexLock lock(&mu_);
  notifier_ = notifier;
}

OrderOutbox::Answering::Answering(OrderOutbox* outbox, const std::string& node_id)
    : outbox_(outbox) {
  absl::MutexLock lock(&outbox_->mu_);
  outbox_->answering_ = node_id;
}

OrderOutbox::Answering::~Answering() {
  absl::MutexLock lock(&outbox_->mu_);
  outbox_->answering_.clear();
}

}  // namespace tessera::coordinator
