// HandOffThread on its own: items worked on in order on the thread, a hand-over that waits for
// the previous item, Stop working on what was handed over, and the busy time reported.
#include "coordinator/scheduling/hand_off_thread.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;

TEST(HandOffThreadTest, WorksOnItemsInOrderOnItsOwnThread) {
  absl::Mutex mu;
  std::vector<int> done;
  std::thread::id worker;
  HandOffThread<int> thread(
      [&](int item) {
        absl::MutexLock lock(&mu);
        done.push_back(item);
        worker = std::this_thread::get_id();
      },
      "test-hand-off");
  thread.Start();
  for (int i = 1; i <= 3; ++i) thread.HandOver(i);
  thread.Stop();
  absl::MutexLock lock(&mu);
  EXPECT_THAT(done, ElementsAre(1, 2, 3));
  EXPECT_NE(worker, std::this_thread::get_id());
}

// The first item's work blocks until released: the second hand-over must wait for it, and the
// producer is free meanwhile (the first hand-over returned at once).
TEST(HandOffThreadTest, AHandOverWaitsUntilThePreviousItemIsDone) {
  absl::Notification first_started, release_first, second_handed;
  HandOffThread<int> thread(
      [&](int item) {
        if (item == 1) {
          first_started.Notify();
          release_first.WaitForNotification();
        }
      },
      "test-hand-off");
  thread.Start();
  thread.HandOver(1);
  first_started.WaitForNotification();
  std::thread producer([&] {
    thread.HandOver(2);
    second_handed.Notify();
  });
  EXPECT_FALSE(second_handed.WaitForNotificationWithTimeout(absl::Milliseconds(100)))
      << "handed over while the previous item was still being worked on";
  release_first.Notify();
  second_handed.WaitForNotification();
  producer.join();
  thread.Stop();
  EXPECT_GE(thread.TakeBusySeconds(), 0.09);
  EXPECT_EQ(thread.TakeBusySeconds(), 0.0) << "taken once";
}

TEST(HandOffThreadTest, StopWorksOnWhatWasHandedOverAndCanStartAgain) {
  int done = 0;
  HandOffThread<int> thread([&](int) { ++done; }, "test-hand-off");
  thread.Start();
  thread.HandOver(1);
  thread.Stop();
  EXPECT_EQ(done, 1);
  thread.Start();
  thread.HandOver(2);
  thread.Stop();
  EXPECT_EQ(done, 2);
  thread.Stop();  // stopped twice: nothing happens
}

}  // namespace
}  // namespace tessera::coordinator
