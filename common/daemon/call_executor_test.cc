#include "common/daemon/call_executor.h"

#include <atomic>
#include <set>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/daemon/executor_metrics.h"
#include "common/daemon/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

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

TEST(CallExecutorTest, TryScheduleRefusesWorkBeyondTheQueueLimit) {
  CallExecutor executor(1, "test-calls", /*nice=*/0, /*max_queued=*/2);
  EXPECT_EQ(executor.max_queued(), 2);
  EXPECT_EQ(executor.name(), "test-calls");
  absl::Notification release, started;
  std::atomic<int> ran{0};
  ASSERT_TRUE(executor.TrySchedule([&] {
    started.Notify();
    release.WaitForNotification();
    ++ran;
  }));
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // The one thread is busy: two may wait, the third is refused and never runs.
  EXPECT_TRUE(executor.TrySchedule([&] { ++ran; }));
  EXPECT_TRUE(executor.TrySchedule([&] { ++ran; }));
  bool refused_ran = false;
  EXPECT_FALSE(executor.TrySchedule([&] { refused_ran = true; }));
  // Schedule is never refused (work that must run, such as a heartbeat's store writes).
  executor.Schedule([&] { ++ran; });
  CallExecutor::Load load = executor.load();
  EXPECT_EQ(load.busy_threads, 1);
  EXPECT_EQ(load.queued, 3);
  EXPECT_EQ(load.refused, 1);
  // What /metrics says of it.
  const std::string text =
      prometheus::TextSerializer().Serialize(ExecutorMetrics({&executor, nullptr}).Collect());
  EXPECT_THAT(text, HasSubstr("tessera_call_executor_threads{executor=\"test-calls\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("tessera_call_executor_busy_threads{executor=\"test-calls\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("tessera_call_executor_queued_calls{executor=\"test-calls\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("tessera_call_executor_refused_total{executor=\"test-calls\"} 1\n"));
  release.Notify();
  EXPECT_TRUE(testing::WaitUntil([&] { return ran.load() == 4; }, absl::Seconds(30)));
  EXPECT_EQ(ran.load(), 4);
  EXPECT_FALSE(refused_ran);
  EXPECT_TRUE(
      testing::WaitUntil([&] { return executor.load().busy_threads == 0; }, absl::Seconds(30)));
  EXPECT_EQ(executor.load().queued, 0);
  EXPECT_EQ(executor.load().refused, 1);
  EXPECT_THAT(ExecutorMetrics({}).Collect(), ::testing::IsEmpty());
  // Room again once the queue drained.
  EXPECT_TRUE(executor.TrySchedule([&] { ++ran; }));
}

TEST(CallExecutorTest, BusyStatusAsksToRetryLater) {
  const absl::Status busy = ExecutorBusy("client-calls", 4096);
  EXPECT_EQ(busy.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(busy.message(),
            "the server is busy: 4096 calls already wait for its client-calls threads; retry in "
            "1 s");
  ASSERT_TRUE(busy.GetPayload(kRetryAfterPayload).has_value());
  EXPECT_EQ(std::string(*busy.GetPayload(kRetryAfterPayload)), "1000");
}

}  // namespace
}  // namespace tessera
