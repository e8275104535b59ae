// The Store's job events (store_events.cc): sequences gap-free per job, reads after a
// sequence, a write's events in one row read back one by one, concurrent commits to one job.
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <memory>
#include <string>
#include <thread>
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
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

TEST_P(StoreBackendTest, EventSequencesAreGapFreePerJob) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);

  JobWrite first;
  first.job_id = "job-a";
  first.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 100);
  first.events = {StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING),
                  StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED)};
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(first);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(1, 2));
  for (const v1::JobEvent& event : *stored) {
    EXPECT_EQ(event.job_id(), "job-a");
    EXPECT_GT(event.time().seconds(), 0) << "time is set when unset";
  }

  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 101), 1);

  JobWrite second;
  second.job_id = "job-a";  // No job upsert: events of an existing job.
  v1::JobEvent timed = StateEvent(v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING);
  timed.mutable_time()->set_seconds(42);
  second.events = {timed, StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED),
                   StateEvent(v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_SUCCEEDED)};
  stored = store->Commit(second);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(3, 4, 5));
  EXPECT_EQ((*stored)[0].time().seconds(), 42) << "a set time is kept";

  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(5));
  EXPECT_THAT(store->LastEventSequence("job-b"), ::tessera::testing::IsOkAndHolds(1));
  EXPECT_THAT(store->LastEventSequence("job-none"), ::tessera::testing::IsOkAndHolds(0));

  absl::StatusOr<std::vector<v1::JobEvent>> all = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(Sequences(*all), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_EQ((*all)[2].state_change().new_state(), v1::JOB_STATE_RUNNING);
}

TEST_P(StoreBackendTest, ReadEventsAfterSequenceWithLimit) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 10);

  absl::StatusOr<std::vector<v1::JobEvent>> after = store->ReadEvents("job-a", 7, 0);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(Sequences(*after), ElementsAre(8, 9, 10));

  after = store->ReadEvents("job-a", 2, 3);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(Sequences(*after), ElementsAre(3, 4, 5));

  after = store->ReadEvents("job-a", 10, 0);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(*after, IsEmpty());
}

// A write's events share one row (schema v3); reads give them one by one, from any point of a
// row, next to rows of one event.
TEST_P(StoreBackendTest, AWritesEventsShareARowAndReadBackOneByOne) {
  const std::string& path = location();
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 1);  // event 1, alone
  JobWrite report;
  report.job_id = "job-a";
  for (int step = 1; step <= 10; ++step) {
    *report.events.emplace_back().mutable_metrics() = Metrics(step, 10.0 / step);
  }
  ASSERT_THAT(store->Commit(report), IsOkAndHolds(SizeIs(10)));  // events 2-11, one row
  JobWrite single;
  single.job_id = "job-a";
  single.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(single);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(12));
  EXPECT_THAT(store->LastEventSequence("job-a"), IsOkAndHolds(12));

  absl::StatusOr<std::vector<v1::JobEvent>> all = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(Sequences(*all), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12));
  for (int i = 1; i <= 10; ++i) {
    EXPECT_EQ((*all)[i].metrics().step(), i);
    EXPECT_EQ((*all)[i].job_id(), "job-a");
  }
  EXPECT_EQ((*all)[11].state_change().new_state(), v1::JOB_STATE_SCHEDULED);
  auto read = [&](int64_t after, int limit) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", after, limit);
    EXPECT_THAT(events, IsOk());
    return events.ok() ? Sequences(*events) : std::vector<int64_t>{-1};
  };
  EXPECT_THAT(read(3, 4), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(read(1, 1), ElementsAre(2));
  EXPECT_THAT(read(10, 0), ElementsAre(11, 12));
  EXPECT_THAT(read(11, 0), ElementsAre(12));
  EXPECT_THAT(read(12, 0), IsEmpty());
  // Three rows hold the twelve events.
  store.reset();
  EXPECT_EQ(QueryValue("SELECT COUNT(*) FROM job_events"), "3");
}

TEST_P(StoreBackendTest, ConcurrentCommitsKeepSequencesGapFree) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  constexpr int kThreads = 4;
  constexpr int kCommitsPerThread = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCommitsPerThread; ++i) {
        JobWrite write;
        write.job_id = "job-a";
        write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
        write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
        EXPECT_THAT(store->Commit(write), IsOk());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(events, IsOk());
  ASSERT_THAT(*events, SizeIs(2 * kThreads * kCommitsPerThread));
  for (size_t i = 0; i < events->size(); ++i) EXPECT_EQ((*events)[i].sequence(), int64_t(i) + 1);
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreBackendTest, kStoreBackends, StoreBackendName);

}  // namespace
}  // namespace tessera::coordinator
