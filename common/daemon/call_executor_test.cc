#include "common/daemon/call_executor.h"

#include <atomic>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(CallExecutorTest, RunsWorkOnItsOwnThreads) {
  absl::Mutex mu;
  std::set<std::thread::id> ran_on;
  int ran = 0;
  {
    CallExecutor executor(3, "test-calls");
    EXPECT_EQ(executor.threads(), 3);
    for (int i = 0; i < 100; ++i) {
      executor.Schedule([&] {
        absl::MutexLock lock(&mu);
        ran_on.insert(std::this_thread::get_id());
        ++ran;
      });
    }
  }  // the destructor runs what is queued before it joins
  EXPECT_EQ(ran, 100);
  EXPECT_FALSE(ran_on.contains(std::this_thread::get_id()));
  EXPECT_LE(ran_on.size(), 3u);
}

TEST(CallExecutorTest, WorkThatWaitsDoesNotHoldUpTheRest) {
  CallExecutor executor(2, "test-calls");
  absl::Notification release, blocked_started, other_done;
  executor.Schedule([&] {
    blocked_started.Notify();
    release.WaitForNotification();
  });
  ASSERT_TRUE(blocked_started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  executor.Schedule([&] { other_done.Notify(); });
  // One thread waits; the other runs the second piece of work meanwhile.
  EXPECT_TRUE(other_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  release.Notify();
}

TEST(CallExecutorTest, AtLeastOneThread) {
  std::atomic<int> ran{0};
  {
    CallExecutor executor(0, "test-calls");
    EXPECT_EQ(executor.threads(), 1);
    executor.Schedule([&] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 1);
}

}  // namespace
}  // namespace tessera
