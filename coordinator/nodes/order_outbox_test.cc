// The order outbox on its own: a held start counts as queued but is neither delivered nor
// announced until released, and withdrawing drops it either way; orders for an unknown node are
// dropped; a lost node's orders go, and it takes no stop until it registers again; orders queued
// while the node's own heartbeat is answered are not announced (they leave with the response);
// and, with a registry, the outbox follows registrations, expiry and removal.
#include "coordinator/nodes/order_outbox.h"

#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "coordinator/nodes/node_registry.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

v1::TaskAssignment Assignment(const std::string& task_id) {
  v1::TaskAssignment assignment;
  assignment.set_task_id(task_id);
  return assignment;
}

// Counts the notices each node's subscription receives (delivered on the notifier's thread).
class Notices {
 public:
  explicit Notices(AssignmentNotifier* notifier) : notifier_(notifier) {}
  void Watch(const std::string& node_id) {
    notifier_->Subscribe(node_id, [this, node_id] {
      absl::MutexLock lock(&mu_);
      ++count_[node_id];
    });
  }
  // Waits (at most 10 s) until `node_id` has had `n` notices; returns how many it had.
  int Await(const std::string& node_id, int n) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_[node_id] >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Seconds(10));
    return count_[node_id];
  }

 private:
  AssignmentNotifier* const notifier_;
  absl::Mutex mu_;
  std::map<std::string, int> count_ ABSL_GUARDED_BY(mu_);
};

TEST(OrderOutboxTest, HeldStartsLeaveAndAreAnnouncedOnlyOnceReleased) {
  AssignmentNotifier notifier;
  Notices notices(&notifier);
  notices.Watch("n1");
  OrderOutbox outbox;
  outbox.SetNotifier(&notifier);
  outbox.Known("n1", /*lost=*/false);

  outbox.QueueStart("n1", Assignment("held"), /*held=*/true);
  outbox.QueueStart("n1", Assignment("free"));
  outbox.QueueStart("n1", Assignment("dropped"), /*held=*/true);
  EXPECT_EQ(notices.Await("n1", 1), 1);
  EXPECT_TRUE(outbox.StartQueued("n1", "held"));

  v1::HeartbeatResponse first;
  outbox.TakeOrders("n1", &first);
  ASSERT_EQ(first.start_size(), 1);
  EXPECT_EQ(first.start(0).task_id(), "free");
  EXPECT_TRUE(outbox.StartQueued("n1", "held"));

  EXPECT_TRUE(outbox.WithdrawStart("n1", "dropped"));
  EXPECT_TRUE(outbox.ReleaseStart("n1", "held"));
  EXPECT_FALSE(outbox.ReleaseStart("n1", "dropped"));
  EXPECT_EQ(notices.Await("n1", 2), 2);
  v1::HeartbeatResponse second;
  outbox.TakeOrders("n1", &second);
  ASSERT_EQ(second.start_size(), 1);
  EXPECT_EQ(second.start(0).task_id(), "held");
  EXPECT_FALSE(outbox.StartQueued("n1", "held"));
}

TEST(OrderOutboxTest, UnknownAndLostNodesHoldNoOrders) {
  OrderOutbox outbox;
  outbox.QueueStart("ghost", Assignment("t1"));
  outbox.QueueStop("ghost", "t1");
  EXPECT_FALSE(outbox.StartQueued("ghost", "t1"));

  outbox.Known("n1", /*lost=*/false);
  outbox.QueueStop("n1", "t1");
  outbox.QueueStop("n1", "t1");  // once per task
  outbox.QueueCheckpointAndStop("n1", "t2", absl::Seconds(30));
  v1::HeartbeatResponse orders;
  outbox.TakeOrders("n1", &orders);
  ASSERT_EQ(orders.stop_size(), 1);
  ASSERT_EQ(orders.checkpoint_and_stop_size(), 1);
  EXPECT_EQ(orders.checkpoint_deadline_seconds().at("t2"), 30.0);

  outbox.QueueStop("n1", "t3");
  outbox.Lost("n1");
  outbox.QueueStop("n1", "t4");
  v1::HeartbeatResponse after_loss;
  outbox.TakeOrders("n1", &after_loss);
  EXPECT_EQ(after_loss.stop_size(), 0) << "a lost node's orders went, and it takes no stop";

  outbox.Known("n1", /*lost=*/false);  // registered again
  outbox.QueueStop("n1", "t5");
  v1::HeartbeatResponse back;
  outbox.TakeOrders("n1", &back);
  EXPECT_EQ(back.stop_size(), 1);
}

TEST(OrderOutboxTest, OrdersQueuedWhileTheNodesHeartbeatIsAnsweredAreNotAnnounced) {
  AssignmentNotifier notifier;
  Notices notices(&notifier);
  notices.Watch("n1");
  notices.Watch("n2");
  OrderOutbox outbox;
  outbox.SetNotifier(&notifier);
  outbox.Known("n1", false);
  outbox.Known("n2", false);
  {
    OrderOutbox::Answering answering(&outbox, "n1");
    outbox.QueueStop("n1", "t1");  // leaves with n1's response
    outbox.QueueStop("n2", "t2");  // announced to n2
  }
  EXPECT_EQ(notices.Await("n2", 1), 1);
  outbox.QueueStop("n1", "t3");
  EXPECT_EQ(notices.Await("n1", 1), 1) << "only the order queued after the answer is announced";
}

TEST(OrderOutboxTest, FollowsTheRegistrysNodes) {
  auto store = Store::Open(":memory:");
  ASSERT_TRUE(store.ok()) << store.status();
  SimulatedClock clock(absl::FromUnixSeconds(1'000'000));
  OrderOutbox outbox;
  NodeRegistry registry(store->get(), absl::Seconds(15), /*write_behind=*/false, &clock, &outbox);
  v1::RegisterNodeRequest request;
  request.set_node_id("n1");
  request.set_address("10.0.0.1:5000");
  request.mutable_resources()->set_cpu_slots(4);
  bool returning = false;
  ASSERT_TRUE(registry.Register(request, &returning).ok());
  outbox.QueueStart("n1", Assignment("t1"));
  EXPECT_TRUE(outbox.StartQueued("n1", "t1"));

  clock.Advance(absl::Seconds(16));
  ASSERT_EQ(registry.Expire().size(), 1u);
  EXPECT_FALSE(outbox.StartQueued("n1", "t1")) << "dropped as the node was lost";
  outbox.QueueStop("n1", "t1");
  ASSERT_TRUE(registry.Register(request, &returning).ok());
  outbox.QueueStop("n1", "t2");
  v1::HeartbeatResponse orders;
  outbox.TakeOrders("n1", &orders);
  ASSERT_EQ(orders.stop_size(), 1);
  EXPECT_EQ(orders.stop(0), "t2");

  outbox.QueueStop("n1", "t3");
  ASSERT_TRUE(registry.SetDrained("n1", true, "removed").ok());
  ASSERT_TRUE(registry.Remove("n1").ok());
  outbox.QueueStart("n1", Assignment("t4"));
  EXPECT_FALSE(outbox.StartQueued("n1", "t4")) << "a removed node is unknown";
}

}  // namespace
}  // namespace tessera::coordinator
