#include "coordinator/jobs/keyed_mutex.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/util/wait.h"

namespace tessera::coordinator {
namespace {

TEST(KeyedMutexTest, OneKeyIsExclusiveAndOtherKeysDoNotWait) {
  KeyedMutex mutex;
  absl::Notification held, release;
  std::thread holder([&] {
    KeyedMutex::Hold hold(&mutex, "job-1");
    held.Notify();
    release.WaitForNotification();
  });
  held.WaitForNotification();
  // Another key is free while job-1 is held.
  { KeyedMutex::Hold other(&mutex, "job-2"); }
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    KeyedMutex::Hold same(&mutex, "job-1");
    got = true;
  });
  // The waiter has come to the key's mutex (it counts as a user before it locks).
  ASSERT_TRUE(testing::WaitUntil([&] { return mutex.users("job-1") == 2; }, absl::Seconds(30)));
  EXPECT_FALSE(got.load()) << "a second holder of the same key must wait";
  release.Notify();
  holder.join();
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(mutex.size(), 0u) << "entries are dropped once nobody holds or waits";
}

TEST(KeyedMutexTest, HoldAllTakesDuplicatesOnceAndSerializesWithSingleHolds) {
  KeyedMutex mutex;
  int counter = 0;  // guarded by the key "c"
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        if ((t + i) % 2 == 0) {
          KeyedMutex::HoldAll all(&mutex, {"z", "c", "a", "c"});
          ++counter;
        } else {
          KeyedMutex::Hold one(&mutex, "c");
          ++counter;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter, 8 * 2000);
  EXPECT_EQ(mutex.size(), 0u);
}

}  // namespace
}  // namespace tessera::coordinator
