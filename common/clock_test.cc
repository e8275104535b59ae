#include "common/clock.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

// Waits (real time) until `clock` has `n` waiters, so an Advance() happens after the wait began.
void AwaitWaiters(const SimulatedClock& clock, int n) {
  testing::WaitUntil([&] { return clock.waiters() >= n; }, absl::Seconds(10),
                     absl::Microseconds(100));
  ASSERT_EQ(clock.waiters(), n);
}

TEST(SimulatedClockTest, MovesOnlyForwardAndOnlyWhenTold) {
  SimulatedClock clock;
  const absl::Time start = clock.Now();
  EXPECT_EQ(start, absl::FromUnixSeconds(1893456000));
  absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(clock.Now(), start);
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(clock.Now(), start + absl::Seconds(5));
  clock.Advance(-absl::Seconds(3));
  clock.AdvanceTo(start);
  EXPECT_EQ(clock.Now(), start + absl::Seconds(5));
  clock.AdvanceTo(start + absl::Hours(1));
  EXPECT_EQ(clock.Now(), start + absl::Hours(1));
}

TEST(SimulatedClockTest, ASleeperWakesWhenTimeReachesItsDeadline) {
  SimulatedClock clock;
  absl::Notification woke;
  std::thread sleeper([&] {
    clock.SleepFor(absl::Minutes(10));
    woke.Notify();
  });
  AwaitWaiters(clock, 1);
  clock.Advance(absl::Minutes(9));
  EXPECT_FALSE(woke.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  clock.Advance(absl::Minutes(1));
  EXPECT_TRUE(woke.WaitForNotificationWithTimeout(absl::Seconds(10)));
  sleeper.join();
  EXPECT_EQ(clock.waiters(), 0);
}

TEST(SimulatedClockTest, AWaiterReturnsOnItsConditionOrOnTheSimulatedDeadline) {
  SimulatedClock clock;
  absl::Mutex mu;
  bool flag = false;

  // The condition comes true: true, without any time passing.
  std::thread setter([&] {
    AwaitWaiters(clock, 1);
    absl::MutexLock lock(&mu);
    flag = true;
  });
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(clock.AwaitWithDeadline(&mu, absl::Condition(&flag), clock.Now() + absl::Hours(1)));
  }
  setter.join();

  // It never does: false once the simulated deadline passes, however little real time that took.
  flag = false;
  std::thread advancer([&] {
    AwaitWaiters(clock, 1);
    clock.Advance(absl::Hours(1));
  });
  {
    absl::MutexLock lock(&mu);
    EXPECT_FALSE(
        clock.AwaitWithDeadline(&mu, absl::Condition(&flag), clock.Now() + absl::Hours(1)));
  }
  advancer.join();
}

TEST(RealClockTest, FollowsTheWallClock) {
  Clock* clock = Clock::Real();
  EXPECT_EQ(clock, Clock::Real());
  const absl::Time before = absl::Now();
  clock->SleepFor(absl::Milliseconds(5));
  EXPECT_GE(clock->Now() - before, absl::Milliseconds(5));
  absl::Mutex mu;
  bool never = false;
  absl::MutexLock lock(&mu);
  EXPECT_FALSE(clock->AwaitWithDeadline(&mu, absl::Condition(&never),
                                        clock->Now() + absl::Milliseconds(5)));
}

}  // namespace
}  // namespace tessera
