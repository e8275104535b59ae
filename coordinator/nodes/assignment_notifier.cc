#include "coordinator/nodes/assignment_notifier.h"

#include <utility>

namespace tessera::coordinator {

AssignmentNotifier::AssignmentNotifier() : dispatcher_([this] { DispatchLoop(); }) {}

AssignmentNotifier::~AssignmentNotifier() {
  Close();
  if (dispatcher_.joinable()) dispatcher_.join();
}

AssignmentNotifier::Handle AssignmentNotifier::Subscribe(const std::string& node_id,
                                                         std::function<void()> on_notice) {
  absl::MutexLock lock(&mu_);
  if (closed_) return 0;
  const Handle handle = next_handle_++;
  subscriptions_[handle] = Subscription{.node_id = node_id, .on_notice = std::move(on_notice)};
  by_node_.emplace(node_id, handle);
  return handle;
}

void AssignmentNotifier::Unsubscribe(Handle handle) {
  absl::MutexLock lock(&mu_);
  auto it = subscriptions_.find(handle);
  if (it == subscriptions_.end()) return;
  auto [first, last] = by_node_.equal_range(it->second.node_id);
  for (auto entry = first; entry != last; ++entry) {
    if (entry->second == handle) {
      by_node_.erase(entry);
      break;
    }
  }
  // A queued entry of the handle is skipped by the dispatcher.
  subscriptions_.erase(it);
}

void AssignmentNotifier::MarkLocked(Handle handle, Subscription& subscription) {
  if (subscription.dirty) return;
  subscription.dirty = true;
  ready_.push_back(handle);
}

void AssignmentNotifier::Notify(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  if (closed_) return;
  auto [first, last] = by_node_.equal_range(node_id);
  for (auto entry = first; entry != last; ++entry) {
    MarkLocked(entry->second, subscriptions_.at(entry->second));
  }
}

void AssignmentNotifier::Close() {
  absl::MutexLock lock(&mu_);
  if (!closed_) {
    closed_ = true;
    for (auto& [handle, subscription] : subscriptions_) MarkLocked(handle, subscription);
  }
  mu_.Await(absl::Condition(&dispatcher_done_));
}

bool AssignmentNotifier::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

int AssignmentNotifier::subscribers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(subscriptions_.size());
}

void AssignmentNotifier::DispatchLoop() {
  absl::MutexLock lock(&mu_);
  auto has_work = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ready_.empty() || closed_; };
  while (true) {
    mu_.Await(absl::Condition(&has_work));
    if (ready_.empty()) break;  // closed, and every closing call made
    const Handle handle = ready_.front();
    ready_.pop_front();
    auto it = subscriptions_.find(handle);
    if (it == subscriptions_.end()) continue;  // unsubscribed while queued
    it->second.dirty = false;
    // A copy: the subscription may go away while the callback runs.
    std::function<void()> on_notice = it->second.on_notice;
    mu_.Unlock();
    on_notice();
    mu_.Lock();
  }
  dispatcher_done_ = true;
}

}  // namespace tessera::coordinator
