// Opening and reading the Store's database (sqlite_database.cc): a file that is not a database,
// reopening, reads on connections of their own (never waiting for a commit, never seeing an
// older state), and blobs that do not parse (DATA_LOSS).
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <sqlite3.h>

#include <atomic>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
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
using ::testing::IsEmpty;
using ::testing::SizeIs;

TEST(StoreTest, OpeningANonDatabaseFileFails) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/not-a-db";
  {
    std::ofstream file(path);
    for (int i = 0; i < 100; ++i) file << "this is a text file, not a SQLite database\n";
  }
  EXPECT_THAT(Store::Open(path), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(path)));
  EXPECT_THAT(Store::Open(dir.path() + "/missing-dir/x.db"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("missing-dir")));
}

TEST(StoreTest, ReopenKeepsData) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 7), 3);
    v1::Node node;
    node.set_node_id("node-a");
    ASSERT_THAT(store->PutNode(node), IsOk());
  }
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<v1::Job> job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->create_time().seconds(), 7);
  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(3));
  absl::StatusOr<std::vector<v1::Node>> nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  EXPECT_THAT(*nodes, SizeIs(1));
  // Sequences continue after a reopen.
  JobWrite more;
  more.job_id = "job-a";
  more.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED));
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(more);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(4));
}

// Reads use a connection of their own: while a commit waits for the database (here another
// connection holds its write lock, as a slow fsync would hold the store), reads answer at once
// with the last committed state, and a write's effect is visible to the next read.
TEST(StoreTest, ReadsDoNotWaitForACommitInProgress) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 1);
  ASSERT_THAT(store->GetJob("job-a"), IsOk());  // read-your-write

  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path.c_str(), &other, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  absl::Notification committed;
  absl::Status commit_status;
  std::thread writer([&] {
    JobWrite write;
    write.job_id = "job-a";
    write.job = MakeJob("job-a", v1::JOB_STATE_SCHEDULED, 1);
    write.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
    commit_status = store->Commit(write).status();
    committed.Notify();
  });
  // The commit now waits for the lock, holding the store: it does not end within 200 ms.
  EXPECT_FALSE(committed.WaitForNotificationWithTimeout(absl::Milliseconds(200)));

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::Job> job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(store->ListWaitingJobs(), IsOkAndHolds(SizeIs(1)));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(1)));
  // The commit waits up to Store::kBusyTimeoutMs (5 s); the reads must not.
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_FALSE(committed.HasBeenNotified());

  ASSERT_EQ(sqlite3_exec(other, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  writer.join();
  ASSERT_THAT(commit_status, IsOk());
  job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(store->ListWaitingJobs(), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(2)));
}

// Reads on many threads share the pool of read-only connections while commits go on. Whichever
// connection a read gets, it sees every commit that returned before it began: a thread never
// sees a job go back, and the events read after the job hold at least the job's.
TEST(StoreTest, ReadsOnManyThreadsNeverSeeAnOlderState) {
  tessera::testing::ScopedTempDir dir("store");
  std::unique_ptr<Store> store = OpenOrDie(dir.path() + "/coordinator.db");
  ASSERT_NE(store, nullptr);
  v1::Job job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 1);
  SubmitJob(*store, job, /*events=*/1);
  constexpr int kCommits = 150;
  constexpr int kReaders = 6;
  std::atomic<bool> done = false;
  std::vector<std::thread> readers;
  std::atomic<int> reads = 0;
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&] {
      int64_t last_step = -1;
      while (!done.load()) {
        absl::StatusOr<v1::Job> read = store->GetJob("job-a");
        ASSERT_THAT(read, IsOk());
        EXPECT_GE(read->current_step(), last_step);
        last_step = read->current_step();
        absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", 0, 0);
        ASSERT_THAT(events, IsOk());
        // One event from the submit, one per commit.
        EXPECT_GE(static_cast<int64_t>(events->size()), last_step + 1);
        reads.fetch_add(1);
      }
    });
  }
  for (int i = 1; i <= kCommits; ++i) {
    job.set_current_step(i);
    JobWrite write;
    write.job_id = "job-a";
    write.job = job;
    write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
    ASSERT_THAT(store->Commit(write), IsOk());
    // Every read that begins now must see step i.
    absl::StatusOr<v1::Job> read = store->GetJob("job-a");
    ASSERT_THAT(read, IsOk());
    EXPECT_EQ(read->current_step(), i);
  }
  done = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_GT(reads.load(), kReaders);
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(kCommits + 1)));
}

TEST(StoreTest, CorruptBlobIsDataLoss) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1), 1);
    JobWrite write;
    write.job_id = "job-a";
    write.metrics.push_back(Metrics(1, 1));
    // Events 2 and 3 in one row.
    *write.events.emplace_back().mutable_metrics() = Metrics(1, 1);
    write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
    ASSERT_THAT(store->Commit(write), IsOk());
  }
  // 0xff is a field header with wire type 7, which no protobuf parser accepts.
  RawExec(path,
          "UPDATE jobs SET job = x'ffffffff'; UPDATE job_events SET event = x'ffffffff';"
          "UPDATE step_metrics SET metrics = x'ffffffff';");
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(store->GetJob("job-a"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job 'job-a' in table jobs")));
  EXPECT_THAT(store->ListJobs({}, 0, ""),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job-a")));
  EXPECT_THAT(store->ListActiveJobs(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job-a")));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job_events")));
  EXPECT_THAT(store->ReadEvents("job-a", 1, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("events 2 to 3")));
  EXPECT_THAT(store->ReadMetrics("job-a", 0, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("step_metrics")));
}

}  // namespace
}  // namespace tessera::coordinator
