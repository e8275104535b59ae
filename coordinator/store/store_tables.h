// The Store's tables as functions on a database connection (SQLite or PostgreSQL): the schema's
// migrations, and the SQL each part of a JobWrite and each job id runs on the writer. Store
// (store.cc) composes them into one write inside a group commit; each family's functions sit in the
// file of its own Store reads (store_jobs.cc, store_events.cc, store_metrics.cc). Internal to
// tessera_store.
//
// Thread safety: none of its own. Each function uses only the connection it is given, which the
// caller holds: the writer inside Database::GroupCommit (or Open's migration), or a
// connection under a Database::ReadLock.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"
#include "tessera/v1/job.pb.h"

namespace tessera::coordinator::store_internal {

// store_migrations.cc: creates the schema or migrates it to Store::kSchemaVersion, in one
// transaction. A schema newer than that: FAILED_PRECONDITION naming `path`.
absl::Status MigrateSchema(DbConnection& writer, const std::string& path);

// store_jobs.cc: inserts the job's row, or updates it (JobWrite::job, request_id).
absl::Status UpsertJob(DbConnection& writer, const std::string& job_id, const v1::Job& job,
                       const std::string& request_id);
// Records `request_id` on a stored job's row.
absl::Status RecordRequestId(DbConnection& writer, const std::string& job_id,
                             const std::string& request_id);
absl::StatusOr<bool> JobExists(DbConnection& connection, const std::string& job_id);
// NextJobId's step inside a batch's transaction: the counter's next value as "job-%08x",
// skipping ids of stored jobs.
absl::StatusOr<std::string> AllocateJobId(DbConnection& writer);

// store_events.cc: the last event sequence stored for `job_id` (0 without events).
absl::StatusOr<int64_t> LastEventSequence(DbConnection& connection, const std::string& job_id,
                                          absl::string_view operation);
// Numbers `events` after the job's last one, stamps them (job_id, time when unset) into
// `stored_events` and inserts them as one row.
absl::Status AppendEvents(DbConnection& writer, const std::string& job_id,
                          const std::vector<v1::JobEvent>& events,
                          std::vector<v1::JobEvent>& stored_events);

// store_metrics.cc: the write's rows keyed (job_id, step): metric points, evaluations and
// checkpoints upserted, then the deleted checkpoints removed.
absl::Status WriteStepRecords(DbConnection& writer, const JobWrite& write);

}  // namespace tessera::coordinator::store_internal
