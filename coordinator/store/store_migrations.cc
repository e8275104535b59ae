// The Store's schema and its migrations (store_tables.h: MigrateSchema), run by the database's
// Open (SQLite or PostgreSQL) on the writer before any other use of the database. The same
// versions on both engines: each migration is written once in the common dialect
// (store_database.h), with a PostgreSQL text of its own only where SQLite's needs no
// counterpart there.
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/store_tables.h"

namespace tessera::coordinator::store_internal {
namespace {

// The PostgreSQL advisory lock a migration holds for its transaction, so that coordinators
// opening one database at once migrate it one after the other (the second finds it done).
// Any constant unlikely to collide with another application's locks in the same database.
constexpr int64_t kMigrationLockKey = 0x7465737365726131;  // "tessera1"

// Schema migrations: kMigrations[v - 1] takes the schema from version v - 1 to
// v. Append only; never edit a migration that has shipped.
struct Migration {
  const char* sql;
  // What PostgreSQL runs instead of `sql`; nullptr: `sql` itself (Exec rewrites its types).
  const char* postgres = nullptr;
};

constexpr Migration kMigrations[] = {
    // v1.
    {R"sql(
CREATE TABLE jobs (
  job_id TEXT PRIMARY KEY NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  create_time_ns INTEGER NOT NULL,
  request_id TEXT UNIQUE,
  job BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX jobs_by_create_time ON jobs (create_time_ns, job_id);
CREATE INDEX jobs_by_state ON jobs (state, create_time_ns, job_id);
CREATE TABLE job_events (
  job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
  sequence INTEGER NOT NULL,
  event BLOB NOT NULL,
  PRIMARY KEY (job_id, sequence)
) WITHOUT ROWID;
CREATE TABLE step_metrics (
  job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
  step INTEGER NOT NULL,
  metrics BLOB NOT NULL,
  PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
CREATE TABLE eval_metrics (
  job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
  step INTEGER NOT NULL,
  metrics BLOB NOT NULL,
  PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
CREATE TABLE checkpoints (
  job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
  step INTEGER NOT NULL,
  checkpoint BLOB NOT NULL,
  PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
CREATE TABLE nodes (
  node_id TEXT PRIMARY KEY NOT NULL,
  node BLOB NOT NULL
) WITHOUT ROWID;
CREATE TABLE counters (
  name TEXT PRIMARY KEY NOT NULL,
  value INTEGER NOT NULL
) WITHOUT ROWID;
)sql"},
    // v2: jobs in a rowid table. A WITHOUT ROWID table keeps its rows in the primary key's
    // b-tree, where a row of more than about 1 KB (a serialized Job is 1-3 KB) spills onto
    // overflow pages, and every rewrite of a job (5-6 in its life) rewrote those. Runs with
    // foreign keys off (SqliteDatabase::Open): dropping the old table then deletes nothing
    // through the other tables' ON DELETE CASCADE, and their REFERENCES jobs name the new one.
    {R"sql(
CREATE TABLE jobs_v2 (
  job_id TEXT PRIMARY KEY NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  create_time_ns INTEGER NOT NULL,
  request_id TEXT UNIQUE,
  job BLOB NOT NULL
);
INSERT INTO jobs_v2 (job_id, state, priority, create_time_ns, request_id, job)
  SELECT job_id, state, priority, create_time_ns, request_id, job FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_v2 RENAME TO jobs;
CREATE INDEX jobs_by_create_time ON jobs (create_time_ns, job_id);
CREATE INDEX jobs_by_state ON jobs (state, create_time_ns, job_id);
)sql",
     // PostgreSQL: nothing to do. Its tables are heaps whatever their key, so v1 already gave
     // it the jobs table v2 gives SQLite; and a table that others reference cannot be dropped
     // there without dropping their foreign keys.
     ""},
    // v3: a write's events in one row. last_sequence NULL: the row holds the one event
    // `sequence` (every row before v3); otherwise it holds the events sequence..last_sequence,
    // its blob their JobEvents one after another, each prefixed with its size as a varint (a
    // report of 10 metric points was 10 rows, about 2.5 us of the store's single writer each).
    {R"sql(
ALTER TABLE job_events ADD COLUMN last_sequence INTEGER;
)sql"},
    // v4: each queue's decayed fair-share usage (Store::SaveQueueUsage), so that a restarted
    // coordinator goes on from it. Every row of one save has the same as_of_ns.
    {R"sql(
CREATE TABLE queue_usage (
  queue TEXT PRIMARY KEY NOT NULL,
  gpu_seconds REAL NOT NULL,
  cpu_slot_seconds REAL NOT NULL,
  as_of_ns INTEGER NOT NULL
) WITHOUT ROWID;
)sql"},
    // v5: per job, the highest step h with a metric point for every step 1..h
    // (Store::MetricsCompleteThrough), which Commit advances as points arrive: reading it had
    // meant reading every step of the job (docs/performance.md). Filled here
    // for the jobs already stored: h is the first step from 1 whose successor is missing, for a
    // job that has step 1; a job without step 1 gets no row (h = 0).
    {R"sql(
CREATE TABLE step_metrics_complete (
  job_id TEXT PRIMARY KEY NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
  through_step INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO step_metrics_complete (job_id, through_step)
  SELECT s.job_id, MIN(s.step) FROM step_metrics s
  WHERE s.step >= 1
    AND EXISTS (SELECT 1 FROM step_metrics f WHERE f.job_id = s.job_id AND f.step = 1)
    AND NOT EXISTS (SELECT 1 FROM step_metrics n WHERE n.job_id = s.job_id AND n.step = s.step + 1)
  GROUP BY s.job_id;
)sql"},
    // v6: checkpoint records follow retention. create_time_ns: the checkpoint's create_time
    // (NULL in rows written before v6); retire_time_ns: when retention deleted it (NULL while it
    // exists). A retired row stays, its blob empty when the checkpoint was never recorded, so
    // that a late report of a deleted checkpoint is recognised and left out.
    {R"sql(
ALTER TABLE checkpoints ADD COLUMN create_time_ns INTEGER;
ALTER TABLE checkpoints ADD COLUMN retire_time_ns INTEGER;
)sql"},
};
static_assert(std::size(kMigrations) == Store::kSchemaVersion);

}  // namespace

absl::Status MigrateSchema(DbConnection& writer, const std::string& path) {
  const std::string operation = absl::StrCat("migrate '", path, "'");
  const bool postgres = writer.dialect() == SqlDialect::kPostgres;
  RETURN_IF_ERROR(writer.Begin(operation));
  absl::Status status = [&]() -> absl::Status {
    if (postgres) {
      ASSIGN_OR_RETURN(Statement lock,
                       writer.Prepare("SELECT pg_advisory_xact_lock(?1)", operation));
      lock.Bind(1, kMigrationLockKey);
      RETURN_IF_ERROR(lock.Step().status());
    }
    RETURN_IF_ERROR(writer.Exec(
        "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)", operation));
    int64_t version = 0;
    {
      // Reset before the migrations run: a table cannot be dropped while a read is open.
      ASSIGN_OR_RETURN(
          Statement select,
          writer.Prepare("SELECT COALESCE(MAX(version), 0) FROM schema_version", operation));
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (has_row) version = select.ColumnInt64(0);
    }
    if (version > Store::kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrCat("store: '", path, "' has schema version ",
                                                        version, ", newer than this binary's ",
                                                        Store::kSchemaVersion));
    }
    for (int64_t next = version + 1; next <= Store::kSchemaVersion; ++next) {
      const Migration& migration = kMigrations[next - 1];
      const char* sql =
          postgres && migration.postgres != nullptr ? migration.postgres : migration.sql;
      if (*sql == '\0') continue;
      RETURN_IF_ERROR(writer.Exec(sql, absl::StrCat(operation, " to schema version ", next)));
    }
    if (version != Store::kSchemaVersion) {
      // SQLite's migrations ran with foreign keys off: check what they left before committing
      // it. PostgreSQL checks every foreign key as it goes.
      if (!postgres) {
        ASSIGN_OR_RETURN(Statement check, writer.Prepare("PRAGMA foreign_key_check", operation));
        ASSIGN_OR_RETURN(bool violated, check.Step());
        if (violated) {
          return absl::DataLossError(
              absl::StrCat("store: ", operation, ": a row of ", check.ColumnText(0),
                           " refers to a missing row of ", check.ColumnText(2)));
        }
      }
      RETURN_IF_ERROR(writer.Exec("DELETE FROM schema_version", operation));
      ASSIGN_OR_RETURN(
          Statement insert,
          writer.Prepare("INSERT INTO schema_version (version) VALUES (?1)", operation));
      insert.Bind(1, Store::kSchemaVersion);
      RETURN_IF_ERROR(insert.Run());
    }
    return absl::OkStatus();
  }();
  return writer.FinishTransaction(std::move(status), operation);
}

}  // namespace tessera::coordinator::store_internal
