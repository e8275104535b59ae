// OrderOutbox: the orders waiting for each node's next heartbeat response (starts, stops,
// checkpoint-and-stops), and their announcement to the node's open WatchAssignments stream
// (AssignmentNotifier), so that a worker learns of a new order without waiting for its next
// heartbeat.
//
// The node registry (node_registry.h) tells the outbox which nodes it may hold orders for: a node
// is known from its registration (or the registry's load) until it is removed; one LOST holds
// nothing (its orders are dropped as it is lost) and takes no stop or checkpoint-and-stop until
// it registers again. Orders for an unknown node are dropped.
//
// A start queued `held` counts as queued (StartQueued, WithdrawStart see it) but is neither
// delivered nor announced until ReleaseStart: the scheduler holds a placement's starts back while
// it stores it. While a node's heartbeat is being answered (Answering), what is queued for it is
// not announced: it leaves with that response.
//
// Thread safety: every method may be called from any thread (mu_). The notifier is called under
// mu_ (AssignmentNotifier::Notify only queues), so nothing here calls back into the cluster.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "tessera/v1/node_service.pb.h"

namespace tessera::coordinator {

class OrderOutbox {
 public:
  // Membership, from the registry: `lost` nodes are known but take only starts.
  void Known(const std::string& node_id, bool lost) ABSL_LOCKS_EXCLUDED(mu_);
  // The node was lost: its orders are dropped.
  void Lost(const std::string& node_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The node was removed: it and its orders are forgotten.
  void Forget(const std::string& node_id) ABSL_LOCKS_EXCLUDED(mu_);

  void QueueStart(const std::string& node_id, v1::TaskAssignment assignment, bool held = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Lets a held start go out with the next heartbeat, and announces it; false when no such start
  // is queued (withdrawn meanwhile).
  bool ReleaseStart(const std::string& node_id, const std::string& task_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes a start not yet delivered, held or not; true when there was one.
  bool WithdrawStart(const std::string& node_id, const std::string& task_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool StartQueued(const std::string& node_id, const std::string& task_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Once per task until delivered.
  void QueueStop(const std::string& node_id, const std::string& task_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks the node to have the task's trainers save a checkpoint and exit
  // (HeartbeatResponse.checkpoint_and_stop); once per task, like QueueStop. With a deadline, the
  // ranks still running that long after the order are stopped; without, the worker's own
  // checkpoint grace applies.
  void QueueCheckpointAndStop(const std::string& node_id, const std::string& task_id,
                              std::optional<absl::Duration> deadline = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the queued orders into `response`, except the held starts.
  void TakeOrders(const std::string& node_id, v1::HeartbeatResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Where orders are announced; null (the default): nowhere. Must outlive the outbox or be
  // replaced first.
  void SetNotifier(AssignmentNotifier* notifier) ABSL_LOCKS_EXCLUDED(mu_);

  // While it lives, orders queued for `node_id` are not announced: the heartbeat being answered
  // carries them. One at a time (heartbeats are answered under the cluster lock).
  class Answering {
   public:
    Answering(OrderOutbox* outbox, const std::string& node_id);
    ~Answering();
    Answering(const Answering&) = delete;
    Answering& operator=(const Answering&) = delete;

   private:
    OrderOutbox* const outbox_;
  };

 private:
  struct Start {
    v1::TaskAssignment assignment;
    bool held = false;
  };
  struct Orders {
    bool lost = false;
    std::vector<Start> to_start;
    std::vector<std::string> to_stop;
    std::vector<std::string> to_checkpoint_and_stop;
    // Deadlines of some of to_checkpoint_and_stop (the others get the worker's grace).
    absl::flat_hash_map<std::string, absl::Duration> checkpoint_deadlines;
  };

  void AnnounceLocked(const std::string& node_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Orders> nodes_ ABSL_GUARDED_BY(mu_);
  AssignmentNotifier* notifier_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string answering_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator
