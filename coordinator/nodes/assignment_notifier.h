// AssignmentNotifier: tells the workers watching (NodeService.WatchAssignments) that the
// coordinator holds new orders for their node, so that they heartbeat at once instead of at their
// next period. It carries no orders, only "look now": the heartbeat response stays the one source
// of assignments, and a lost notice costs at most one heartbeat period.
//
// Notify() never blocks and never calls out: it sets the node's subscriptions dirty and wakes a
// dispatcher thread, which calls each dirty subscription's callback outside every lock. A
// subscription is dirty or not, so notices coalesce: however many decisions come in while a
// callback runs (or a stream is slow to take a write), the subscriber is called once more at most.
// The scheduler therefore never waits for a stream.
//
// Thread safety: every method may be called from any thread, Notify() under the caller's locks.
// Callbacks run on the dispatcher thread, one at a time; a callback must not block and may call
// back into the notifier (Subscribe, Unsubscribe). After Unsubscribe() returns, the callback is
// never called again unless it is running at that moment: a subscriber whose callback outlives it
// guards its state itself (e.g. a shared_ptr the callback holds).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"

namespace tessera::coordinator {

class AssignmentNotifier {
 public:
  using Handle = int64_t;

  AssignmentNotifier();
  // Closes, then joins the dispatcher.
  ~AssignmentNotifier();
  AssignmentNotifier(const AssignmentNotifier&) = delete;
  AssignmentNotifier& operator=(const AssignmentNotifier&) = delete;

  // Calls `on_notice` after each Notify(node_id) (coalesced), and once more when the notifier
  // closes. Returns a handle for Unsubscribe, or 0 when the notifier is closed (nothing is called).
  Handle Subscribe(const std::string& node_id, std::function<void()> on_notice);
  void Unsubscribe(Handle handle);

  // The coordinator holds new orders for `node_id`. Cheap: a map lookup under a leaf mutex.
  void Notify(const std::string& node_id);

  // Shutdown: from now on closed() is true, Subscribe refuses, and every subscriber is called
  // once more so that its stream can end (a watcher reconnects to the next coordinator). Returns
  // once those calls have been made.
  void Close();
  bool closed() const;

  // Subscriptions open now (for tests and metrics).
  int subscribers() const;

 private:
  struct Subscription {
    std::string node_id;
    std::function<void()> on_notice;
    bool dirty = false;
  };
  void DispatchLoop();
  // Marks the subscription dirty and queues it, unless it already is.
  void MarkLocked(Handle handle, Subscription& subscription) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  // Set when the dispatcher has delivered the closing calls and exits.
  bool dispatcher_done_ ABSL_GUARDED_BY(mu_) = false;
  Handle next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<Handle, Subscription> subscriptions_ ABSL_GUARDED_BY(mu_);
  // Handles of nodes' subscriptions, by node_id.
  std::multimap<std::string, Handle> by_node_ ABSL_GUARDED_BY(mu_);
  // Dirty subscriptions in the order they became dirty; at most one entry per subscription.
  std::deque<Handle> ready_ ABSL_GUARDED_BY(mu_);
  std::thread dispatcher_;
};

}  // namespace tessera::coordinator
