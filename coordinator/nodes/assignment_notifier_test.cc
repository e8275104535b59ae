// AssignmentNotifier: notices reach only the node's subscribers, coalesce while a subscriber is
// busy, never block Notify, and Close calls every subscriber once and refuses new ones.
#include "coordinator/nodes/assignment_notifier.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/util/wait.h"

namespace tessera::coordinator {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);

// Polls `done` until it holds or kWait passes.
template <typename F>
bool Eventually(F done) {
  return testing::WaitUntil(done, kWait, absl::Milliseconds(1));
}

TEST(AssignmentNotifierTest, NotifiesOnlyTheNodesSubscribers) {
  AssignmentNotifier notifier;
  std::atomic<int> a{0}, b{0}, a2{0};
  ASSERT_NE(notifier.Subscribe("node-a", [&] { ++a; }), 0);
  ASSERT_NE(notifier.Subscribe("node-b", [&] { ++b; }), 0);
  ASSERT_NE(notifier.Subscribe("node-a", [&] { ++a2; }), 0);
  EXPECT_EQ(notifier.subscribers(), 3);
  notifier.Notify("node-a");
  ASSERT_TRUE(Eventually([&] { return a == 1 && a2 == 1; }));
  notifier.Notify("node-c");  // nobody watches it
  notifier.Notify("node-a");
  ASSERT_TRUE(Eventually([&] { return a == 2 && a2 == 2; }));
  // The dispatcher handles notices in order: node-c's (none) and node-a's came after nothing of
  // node-b's, so node-b was never called.
  EXPECT_EQ(b, 0);
}

TEST(AssignmentNotifierTest, NoticesCoalesceWhileTheSubscriberIsBusy) {
  AssignmentNotifier notifier;
  absl::Notification entered, release;
  std::atomic<int> calls{0};
  std::atomic<int> sentinel{0};
  notifier.Subscribe("node-z", [&] { ++sentinel; });
  notifier.Subscribe("node-a", [&] {
    if (++calls == 1) {
      entered.Notify();
      release.WaitForNotification();
    }
  });
  notifier.Notify("node-a");
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kWait));
  // The first call is blocked: a burst of decisions makes one more call, not a thousand, and
  // Notify returns at once even though the subscriber is stuck.
  const absl::Time start = absl::Now();
  for (int i = 0; i < 1000; ++i) notifier.Notify("node-a");
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  release.Notify();
  ASSERT_TRUE(Eventually([&] { return calls == 2; }));
  // Notices are handled in order: once a later one's callback ran, a third call of node-a's
  // would have come before it.
  notifier.Notify("node-z");
  ASSERT_TRUE(Eventually([&] { return sentinel == 1; }));
  EXPECT_EQ(calls, 2);
}

TEST(AssignmentNotifierTest, AStuckSubscriberDelaysOthersButNeverTheNotifier) {
  AssignmentNotifier notifier;
  absl::Notification release;
  std::atomic<int> other{0};
  notifier.Subscribe("slow", [&] { release.WaitForNotification(); });
  notifier.Subscribe("fast", [&] { ++other; });
  notifier.Notify("slow");
  notifier.Notify("fast");
  release.Notify();
  ASSERT_TRUE(Eventually([&] { return other == 1; }));
}

TEST(AssignmentNotifierTest, UnsubscribedCallbacksAreNotCalled) {
  AssignmentNotifier notifier;
  std::atomic<int> calls{0};
  const AssignmentNotifier::Handle handle = notifier.Subscribe("node-a", [&] { ++calls; });
  notifier.Unsubscribe(handle);
  notifier.Unsubscribe(handle);  // twice is harmless
  EXPECT_EQ(notifier.subscribers(), 0);
  notifier.Notify("node-a");
  // A later subscriber proves the dispatcher went past the notice.
  std::atomic<int> probe{0};
  notifier.Subscribe("node-a", [&] { ++probe; });
  notifier.Notify("node-a");
  ASSERT_TRUE(Eventually([&] { return probe == 1; }));
  EXPECT_EQ(calls, 0);
}

TEST(AssignmentNotifierTest, CloseCallsEverySubscriberOnceAndRefusesNewOnes) {
  AssignmentNotifier notifier;
  std::atomic<int> a{0}, b{0};
  std::atomic<bool> saw_closed{false};
  notifier.Subscribe("node-a", [&] {
    ++a;
    saw_closed = notifier.closed();
  });
  notifier.Subscribe("node-b", [&] { ++b; });
  notifier.Close();
  // Close returns once the closing calls were made.
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 1);
  EXPECT_TRUE(saw_closed);
  EXPECT_TRUE(notifier.closed());
  EXPECT_EQ(notifier.Subscribe("node-a", [] {}), 0);
  notifier.Notify("node-a");
  notifier.Close();  // again: no more calls
  EXPECT_EQ(a, 1);
}

TEST(AssignmentNotifierTest, CallbacksMayUnsubscribeThemselves) {
  AssignmentNotifier notifier;
  std::atomic<int> calls{0};
  std::atomic<AssignmentNotifier::Handle> handle{0};
  handle = notifier.Subscribe("node-a", [&] {
    ++calls;
    notifier.Unsubscribe(handle);
  });
  notifier.Notify("node-a");
  ASSERT_TRUE(Eventually([&] { return notifier.subscribers() == 0; }));
  notifier.Notify("node-a");
  notifier.Close();
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace tessera::coordinator
