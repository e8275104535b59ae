// The Store's saved fair-share usage (store_queue_usage.cc): saved and loaded whole, each save
// replacing the last, kept across reopening the database.
//
// Thread safety: each test owns its store.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;

std::vector<std::string> Queues(const SavedQueueUsage& usage) {
  std::vector<std::string> queues;
  for (const auto& [queue, unused] : usage.queues) queues.push_back(queue);
  return queues;
}

TEST(StoreTest, QueueUsageIsSavedWholeAndReplaced) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(store->LoadQueueUsage(), IsOkAndHolds(::testing::Eq(std::nullopt)));

  const absl::Time first_time = absl::FromUnixSeconds(1'700'000'000) + absl::Nanoseconds(123);
  SavedQueueUsage first;
  first.as_of = first_time;
  first.queues["nlp"] = {.gpu_seconds = 12345.678, .cpu_slot_seconds = 0.25};
  first.queues["vision"] = {.gpu_seconds = 0, .cpu_slot_seconds = 1e9};
  ASSERT_THAT(store->SaveQueueUsage(first), IsOk());
  absl::StatusOr<std::optional<SavedQueueUsage>> loaded = store->LoadQueueUsage();
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->as_of, first_time);  // to the nanosecond
  EXPECT_THAT(Queues(**loaded), ElementsAre("nlp", "vision"));
  EXPECT_EQ((*loaded)->queues["nlp"].gpu_seconds, 12345.678);
  EXPECT_EQ((*loaded)->queues["nlp"].cpu_slot_seconds, 0.25);
  EXPECT_EQ((*loaded)->queues["vision"].cpu_slot_seconds, 1e9);

  // A later save replaces the whole map: a queue it leaves out (removed from the queue file, or
  // decayed away) is forgotten, the others take the new values and time.
  SavedQueueUsage second;
  second.as_of = first_time + absl::Seconds(30);
  second.queues["vision"] = {.gpu_seconds = 2, .cpu_slot_seconds = 3};
  second.queues["speech"] = {.gpu_seconds = 4, .cpu_slot_seconds = 0};
  ASSERT_THAT(store->SaveQueueUsage(second), IsOk());
  store.reset();

  // Kept across reopening the database (a coordinator restart).
  store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  loaded = store->LoadQueueUsage();
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->as_of, second.as_of);
  EXPECT_THAT(Queues(**loaded), ElementsAre("speech", "vision"));
  EXPECT_EQ((*loaded)->queues["vision"].gpu_seconds, 2);
  EXPECT_EQ((*loaded)->queues["vision"].cpu_slot_seconds, 3);
  EXPECT_EQ((*loaded)->queues["speech"].gpu_seconds, 4);

  // Saving nothing forgets everything.
  ASSERT_THAT(store->SaveQueueUsage(SavedQueueUsage{.as_of = second.as_of}), IsOk());
  EXPECT_THAT(store->LoadQueueUsage(), IsOkAndHolds(::testing::Eq(std::nullopt)));
}

TEST(StoreTest, QueueUsageWithAnEmptyQueueNameIsRefusedUnapplied) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  SavedQueueUsage saved;
  saved.as_of = absl::FromUnixSeconds(100);
  saved.queues["nlp"] = {.gpu_seconds = 1};
  ASSERT_THAT(store->SaveQueueUsage(saved), IsOk());
  SavedQueueUsage bad = saved;
  bad.queues[""] = {.gpu_seconds = 2};
  bad.queues["nlp"] = {.gpu_seconds = 3};
  EXPECT_THAT(store->SaveQueueUsage(bad),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("queue name")));
  absl::StatusOr<std::optional<SavedQueueUsage>> loaded = store->LoadQueueUsage();
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_THAT((*loaded)->queues, ElementsAre(Pair("nlp", ::testing::_)));
  EXPECT_EQ((*loaded)->queues["nlp"].gpu_seconds, 1);
}

}  // namespace
}  // namespace tessera::coordinator
