// The Store's schema migrations (store_migrations.cc): a database of every earlier version
// migrated on open, on SQLite and on a private PostgreSQL (tests/postgres_fixture.h; those cases
// skip, saying why, when it cannot start), and a newer schema refused (on PostgreSQL:
// store_postgres_test).
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
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
using ::testing::SizeIs;

// Undoes one migration (store_migrations.cc) on each backend: `postgres` is what PostgreSQL
// runs instead of `sqlite` (nullptr: the same text; "": nothing, as the migration did nothing
// there).
struct Undo {
  const char* sqlite;
  const char* postgres = nullptr;
};

// kUndo[v - 1] takes the schema from version v + 1 back to v.
constexpr Undo kUndo[] = {
    // To 1: jobs in a WITHOUT ROWID table. PostgreSQL's v2 did nothing (its tables are heaps).
    {R"sql(
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
     ""},
    // To 2: a row per event.
    {"ALTER TABLE job_events DROP COLUMN last_sequence;"},
    // To 3: no saved queue usage.
    {"DROP TABLE queue_usage;"},
    // To 4: no per-job mark of the complete metric steps.
    {"DROP TABLE step_metrics_complete;"},
    // To 5: checkpoint records without their creation and retirement times.
    {"ALTER TABLE checkpoints DROP COLUMN retire_time_ns;\n"
     "ALTER TABLE checkpoints DROP COLUMN create_time_ns;\n"},
};
static_assert(std::size(kUndo) == Store::kSchemaVersion - 1);

// The migrations run against each backend from each earlier version: (backend, version).
using MigrationCase = std::tuple<StoreBackend, int>;

class StoreMigrationTest : public ::testing::TestWithParam<MigrationCase> {
 protected:
  void SetUp() override {
    if (!postgres()) {
      location_ = dir_.path() + "/coordinator.db";
      return;
    }
    tessera::testing::PostgresCluster& cluster = tessera::testing::PostgresCluster::Shared();
    location_ = cluster.NewDatabase();
    if (location_.empty()) GTEST_SKIP() << "no PostgreSQL server: " << cluster.Reason();
  }

  bool postgres() const { return std::get<0>(GetParam()) == StoreBackend::kPostgres; }
  int from_version() const { return std::get<1>(GetParam()); }
  const std::string& location() const { return location_; }

  // The first column of the first row of `sql`, behind the store's back.
  std::string Query(const char* sql) {
    return postgres() ? RawPostgresQuery(location_, sql) : RawQuery(location_, sql);
  }
  // `sqlite` on SQLite, `postgres` on PostgreSQL: the catalogs differ.
  std::string Query(const char* sqlite, const char* postgres) {
    return Query(this->postgres() ? postgres : sqlite);
  }

  // Takes a database of the current schema back to `version`'s layout, as a binary of that
  // version left it: each step undoes one migration, newest first, in one transaction.
  void Downgrade(int version) {
    std::string sql = postgres() ? "BEGIN;\n" : "PRAGMA foreign_keys = OFF;\nBEGIN;\n";
    for (int to = Store::kSchemaVersion - 1; to >= version; --to) {
      const Undo& undo = kUndo[to - 1];
      absl::StrAppend(&sql, postgres() && undo.postgres != nullptr ? undo.postgres : undo.sqlite);
    }
    absl::StrAppend(&sql, "UPDATE schema_version SET version = ", version, ";\nCOMMIT;\n");
    if (postgres()) {
      RawPostgresExec(location_, sql.c_str());
    } else {
      RawExec(location_, sql.c_str());
    }
  }

 private:
  tessera::testing::ScopedTempDir dir_{"store"};
  std::string location_;
};

// A database written by each earlier schema version is migrated on open to the current one, on
// SQLite and on PostgreSQL: from version 1 (jobs in a WITHOUT ROWID table on SQLite, a row per
// event), through version 3 (a write's events in one row), version 4 (the queues' saved
// fair-share usage), version 5 (each job's mark of its complete metric steps, which the
// migration finds from the steps stored) and version 6 (checkpoint records that retention
// retires). Every job, event, metric point and checkpoint survives
// (dropping SQLite's old jobs table must not cascade into the others), the foreign keys hold
// afterwards, and what each later version added works.
TEST_P(StoreMigrationTest, MigratesAnOlderDatabase) {
  {
    std::unique_ptr<Store> store = OpenOrDie(location());
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
      // Complete metric steps: job-0 1..6, job-1 none (no step 1), job-2 1..2 (3 missing).
      if (i == 0) second.metrics = {Metrics(1, 2), Metrics(2, 2), Metrics(3, 2), Metrics(4, 2)};
      if (i == 2) second.metrics = {Metrics(1, 2), Metrics(2, 2), Metrics(4, 2)};
      ASSERT_THAT(store->Commit(second), IsOk());
    }
  }
  constexpr int64_t kCompleteThrough[] = {6, 0, 2};
  constexpr size_t kMetricPoints[] = {6, 2, 5};
  Downgrade(from_version());
  ASSERT_EQ(Query("SELECT version FROM schema_version"), std::to_string(from_version()));
  constexpr char kQueueUsageTables[] =
      "SELECT count(*) FROM sqlite_master WHERE name = 'queue_usage'";
  constexpr char kPostgresQueueUsageTables[] =
      "SELECT count(*) FROM pg_tables WHERE tablename = 'queue_usage'";
  ASSERT_EQ(Query(kQueueUsageTables, kPostgresQueueUsageTables), from_version() < 4 ? "0" : "1");
  constexpr char kEventColumns[] = "SELECT count(*) FROM pragma_table_info('job_events')";
  constexpr char kPostgresEventColumns[] =
      "SELECT count(*) FROM information_schema.columns WHERE table_name = 'job_events'";
  ASSERT_EQ(Query(kEventColumns, kPostgresEventColumns), from_version() < 3 ? "3" : "4");
  if (from_version() < 2 && !postgres()) {
    ASSERT_THAT(Query("SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
                HasSubstr("WITHOUT ROWID"));
  }

  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(Query("SELECT version FROM schema_version"), std::to_string(Store::kSchemaVersion));
  EXPECT_EQ(Query(kEventColumns, kPostgresEventColumns), "4");
  EXPECT_EQ(Query(kQueueUsageTables, kPostgresQueueUsageTables), "1");
  if (!postgres()) {
    EXPECT_THAT(Query("SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
                ::testing::Not(HasSubstr("WITHOUT ROWID")));
  }
  EXPECT_EQ(Query("SELECT \"table\" FROM pragma_foreign_key_list('job_events')",
                  "SELECT confrelid::regclass::text FROM pg_constraint "
                  "WHERE conrelid = 'job_events'::regclass AND contype = 'f'"),
            "jobs");
  // The primary key, the request id's uniqueness, by create time and by state.
  EXPECT_EQ(Query("SELECT count(*) FROM pragma_index_list('jobs')",
                  "SELECT count(*) FROM pg_indexes WHERE tablename = 'jobs'"),
            "4");
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
    EXPECT_THAT(store->ReadMetrics(job_id, 0, 0), IsOkAndHolds(SizeIs(kMetricPoints[i])));
    // Before version 5 nothing kept it: the migration finds it from the stored steps.
    EXPECT_THAT(store->MetricsCompleteThrough(job_id, 0), IsOkAndHolds(kCompleteThrough[i]));
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

  // The mark goes on from where the migration left it: job-2's gap filled.
  JobWrite fill;
  fill.job_id = "job-2";
  fill.metrics = {Metrics(3, 2)};
  ASSERT_THAT(store->Commit(fill), IsOk());
  EXPECT_THAT(store->MetricsCompleteThrough("job-2", 0), IsOkAndHolds(6));

  // A checkpoint recorded before version 6 (no creation time) is retired like a new one.
  JobWrite retire;
  retire.job_id = "job-0";
  retire.retired_checkpoints = {{6, absl::FromUnixSeconds(1000)}};
  ASSERT_THAT(store->Commit(retire), IsOk());
  EXPECT_THAT(store->ListCheckpoints("job-0"), IsOkAndHolds(SizeIs(0)));
  EXPECT_THAT(store->ListCheckpoints("job-1"), IsOkAndHolds(SizeIs(1)));
}

INSTANTIATE_TEST_SUITE_P(
    EveryEarlierVersion, StoreMigrationTest,
    ::testing::Combine(kStoreBackends, ::testing::Range(1, Store::kSchemaVersion)),
    [](const ::testing::TestParamInfo<MigrationCase>& info) {
      return absl::StrCat(std::get<0>(info.param) == StoreBackend::kSqlite ? "Sqlite" : "Postgres",
                          "FromVersion", std::get<1>(info.param));
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
