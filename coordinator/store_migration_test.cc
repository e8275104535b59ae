// The Store's schema migrations (store_migrations.cc): a file of every earlier version migrated
// on open, a newer schema refused.
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <iterator>
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

// Takes a database of the current schema back to `version`'s layout, as a binary of that version
// left it: each step undoes one migration (store_migrations.cc), newest first.
void Downgrade(const std::string& path, int version) {
  // kUndo[v - 1] takes the schema from version v + 1 back to v.
  constexpr const char* kUndo[] = {
      // To 1: jobs in a WITHOUT ROWID table.
      R"sql(
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
)sql",
      // To 2: a row per event.
      "ALTER TABLE job_events DROP COLUMN last_sequence;",
      // To 3: no saved queue usage.
      "DROP TABLE queue_usage;",
  };
  static_assert(std::size(kUndo) == Store::kSchemaVersion - 1);
  std::string sql = "PRAGMA foreign_keys = OFF;\nBEGIN;\n";
  for (int to = Store::kSchemaVersion - 1; to >= version; --to)
    absl::StrAppend(&sql, kUndo[to - 1]);
  absl::StrAppend(&sql, "UPDATE schema_version SET version = ", version, ";\nCOMMIT;\n");
  RawExec(path, sql.c_str());
}

class StoreMigrationTest : public ::testing::TestWithParam<int> {};

// A database written by each earlier schema version is migrated on open to the current one:
// from version 1 (jobs in a WITHOUT ROWID table, a row per event), through version 3 (a write's
// events in one row) and version 4 (the queues' saved fair-share usage). Every job, event,
// metric point and checkpoint survives (dropping the old jobs table must not cascade into the
// others), foreign keys are on again afterwards, and what each later version added works.
TEST_P(StoreMigrationTest, MigratesAnOlderDatabase) {
  const int from_version = GetParam();
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
  Downgrade(path, from_version);
  ASSERT_EQ(RawQuery(path, "SELECT version FROM schema_version"), std::to_string(from_version));
  ASSERT_EQ(RawQuery(path, "SELECT count(*) FROM sqlite_master WHERE name = 'queue_usage'"), "0");
  if (from_version < 3) {
    ASSERT_EQ(RawQuery(path, "SELECT count(*) FROM pragma_table_info('job_events')"), "3");
  }
  if (from_version < 2) {
    ASSERT_THAT(RawQuery(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
                HasSubstr("WITHOUT ROWID"));
  }

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

  // The queue usage table is there, empty.
  EXPECT_THAT(store->LoadQueueUsage(), IsOkAndHolds(::testing::Eq(std::nullopt)));
  SavedQueueUsage usage;
  usage.as_of = absl::FromUnixSeconds(1000);
  usage.queues["nlp"] = {.gpu_seconds = 7, .cpu_slot_seconds = 8};
  ASSERT_THAT(store->SaveQueueUsage(usage), IsOk());
  absl::StatusOr<std::optional<SavedQueueUsage>> loaded = store->LoadQueueUsage();
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->as_of, usage.as_of);
  EXPECT_EQ((*loaded)->queues["nlp"].cpu_slot_seconds, 8);
}

INSTANTIATE_TEST_SUITE_P(EveryEarlierVersion, StoreMigrationTest,
                         ::testing::Range(1, Store::kSchemaVersion),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("FromVersion", info.param);
                         });

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
