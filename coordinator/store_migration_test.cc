// The Store's schema migrations (store_migrations.cc): a version 1 file migrated on open, a
// newer schema refused.
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "coordinator/store.h"
#include "coordinator/store_test_util.h"
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
using ::testing::SizeIs;

// A database written by schema version 1 (jobs in a WITHOUT ROWID table, a row per event) is
// migrated on open, through version 3 (a write's events in one row):
// every job, event, metric point and checkpoint survives (dropping the old jobs table must not
// cascade into the others), and foreign keys are on again afterwards.
TEST(StoreTest, MigratesAVersion1Database) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) {
      JobWrite write;
      write.job_id = absl::StrCat("job-", i);
      write.job = MakeJob(write.job_id, v1::JOB_STATE_RUNNING, 100 + i);
      write.request_id = absl::StrCat("req-", i);
      // One event a write: before version 3 every event had a row of its own.
      write.events = {StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING)};
      write.metrics = {Metrics(5, 1.5), Metrics(6, 1.25)};
      v1::Checkpoint checkpoint;
      checkpoint.set_step(6);
      write.checkpoints.push_back(checkpoint);
      ASSERT_THAT(store->Commit(write), IsOk());
      JobWrite second;
      second.job_id = write.job_id;
      second.events = {StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING)};
      ASSERT_THAT(store->Commit(second), IsOk());
    }
  }
  // Back to version 1's layout, as a version 1 binary left it.
  RawExec(path, R"sql(
PRAGMA foreign_keys = OFF;
BEGIN;
CREATE TABLE jobs_v1 (
  job_id TEXT PRIMARY KEY NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  create_time_ns INTEGER NOT NULL,
  request_id TEXT UNIQUE,
  job BLOB NOT NULL
) WITHOUT ROWID;
INSERT INTO jobs_v1 SELECT job_id, state, priority, create_time_ns, request_id, job FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_v1 RENAME TO jobs;
CREATE INDEX jobs_by_create_time ON jobs (create_time_ns, job_id);
CREATE INDEX jobs_by_state ON jobs (state, create_time_ns, job_id);
ALTER TABLE job_events DROP COLUMN last_sequence;
UPDATE schema_version SET version = 1;
COMMIT;
)sql");
  ASSERT_EQ(RawQuery(path, "SELECT count(*) FROM pragma_table_info('job_events')"), "3");
  ASSERT_THAT(RawQuery(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
              HasSubstr("WITHOUT ROWID"));

  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawQuery(path, "SELECT version FROM schema_version"),
            std::to_string(Store::kSchemaVersion));
  EXPECT_THAT(RawQuery(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
              ::testing::Not(HasSubstr("WITHOUT ROWID")));
  EXPECT_EQ(RawQuery(path, "SELECT \"table\" FROM pragma_foreign_key_list('job_events')"), "jobs");
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM pragma_index_list('jobs')"), "4");
  for (int i = 0; i < 3; ++i) {
    const std::string job_id = absl::StrCat("job-", i);
    absl::StatusOr<std::optional<v1::Job>> found =
        store->FindJobByRequestId(absl::StrCat("req-", i));
    ASSERT_THAT(found, IsOk());
    ASSERT_TRUE(found->has_value());
    EXPECT_EQ((*found)->job_id(), job_id);
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents(job_id, 0, 0);
    ASSERT_THAT(events, IsOk());
    EXPECT_THAT(Sequences(*events), ElementsAre(1, 2));
    EXPECT_THAT(store->ReadMetrics(job_id, 0, 0), IsOkAndHolds(SizeIs(2)));
    EXPECT_THAT(store->ListCheckpoints(job_id), IsOkAndHolds(SizeIs(1)));
  }
  absl::StatusOr<JobPage> page = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-2", "job-1", "job-0"));

  // Writing goes on where it stopped.
  JobWrite next;
  next.job_id = "job-1";
  next.job = MakeJob("job-1", v1::JOB_STATE_SUCCEEDED, 101);
  next.events = {StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED)};
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(next);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(3));
  EXPECT_THAT(store->ListActiveJobs(), IsOkAndHolds(SizeIs(2)));
}

TEST(StoreTest, NewerSchemaIsRefused) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  ASSERT_NE(OpenOrDie(path), nullptr);
  RawExec(path, "UPDATE schema_version SET version = 99");
  EXPECT_THAT(Store::Open(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("schema version 99")));
}

}  // namespace
}  // namespace tessera::coordinator
