// The Store's rows keyed (job_id, step): metric points (`step_metrics`), evaluations
// (`eval_metrics`) and checkpoint records (`checkpoints`); a resent step replaces the old row.
// `step_metrics_complete` keeps, per job, the end of the first run of metric steps without a gap
// (Store::MetricsCompleteThrough), advanced by the writes that store the step just above it.
// Store's reads run under a Database::ReadLock; WriteStepRecords (store_tables.h) runs on
// the writer in a group commit.
#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"
#include "coordinator/store/store_tables.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;

// Reads (step, blob) rows into messages, naming `table` on a bad blob.
template <typename Message>
absl::StatusOr<std::vector<Message>> ReadStepRows(Statement& select, const std::string& job_id,
                                                  absl::string_view table) {
  std::vector<Message> rows;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    const int64_t step = select.ColumnInt64(0);
    RETURN_IF_ERROR(select.ColumnMessage(
        1, rows.emplace_back(),
        absl::StrCat("step ", step, " of job '", job_id, "' in table ", table)));
  }
  return rows;
}

// Rows of a (job_id, step, metrics) table with from_step <= step <= to_step (0 = no upper
// bound), in step order.
template <typename Message>
absl::StatusOr<std::vector<Message>> ReadStepRange(Database& database, const char* table,
                                                   const std::string& job_id, int64_t from_step,
                                                   int64_t to_step) {
  Database::ReadLock lock(database);
  DbConnection& reader = lock.connection();
  const std::string operation = absl::StrCat("read ", table, " of ", job_id);
  // `table` is one of ours, never input: the SQL stays a fixed set of strings.
  ASSIGN_OR_RETURN(Statement select,
                   reader.Prepare(absl::StrCat("SELECT step, metrics FROM ", table,
                                               " WHERE job_id = ?1 AND step >= ?2 AND step <= ?3 "
                                               "ORDER BY step"),
                                  operation));
  select.BindText(1, job_id);
  select.Bind(2, from_step);
  select.Bind(3, to_step == 0 ? std::numeric_limits<int64_t>::max() : to_step);
  return ReadStepRows<Message>(select, job_id, table);
}

// Moves `job_id`'s step_metrics_complete mark over the metric steps now stored without a gap,
// after `points` were upserted. Reads the stored steps only when `points` hold the step just
// above the mark, and then only up to the first gap: over a job's life each point is passed once
// (a long gap filled late passes the points stored beyond it then).
absl::Status AdvanceMetricsComplete(DbConnection& writer, const std::string& job_id,
                                    const std::vector<v1::StepMetrics>& points) {
  const std::string operation = absl::StrCat("advance the complete metric steps of ", job_id);
  int64_t through = 0;
  {
    ASSIGN_OR_RETURN(
        Statement select,
        writer.Prepare("SELECT through_step FROM step_metrics_complete WHERE job_id = ?1",
                       operation));
    select.BindText(1, job_id);
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (has_row) through = select.ColumnInt64(0);
  }
  if (std::none_of(points.begin(), points.end(),
                   [&](const v1::StepMetrics& point) { return point.step() == through + 1; })) {
    return absl::OkStatus();
  }
  int64_t advanced = through;
  {
    ASSIGN_OR_RETURN(Statement select,
                     writer.Prepare("SELECT step FROM step_metrics WHERE job_id = ?1 AND step > ?2 "
                                    "ORDER BY step",
                                    operation));
    select.BindText(1, job_id);
    select.Bind(2, through);
    while (true) {
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (!has_row || select.ColumnInt64(0) != advanced + 1) break;
      ++advanced;
    }
  }
  ASSIGN_OR_RETURN(Statement upsert, writer.Prepare(R"sql(
INSERT INTO step_metrics_complete (job_id, through_step) VALUES (?1, ?2)
ON CONFLICT (job_id) DO UPDATE SET through_step = excluded.through_step)sql",
                                                    operation));
  upsert.BindText(1, job_id);
  upsert.Bind(2, advanced);
  return upsert.Run();
}

}  // namespace

namespace store_internal {

absl::Status WriteStepRecords(DbConnection& writer, const JobWrite& write) {
  const std::string& job_id = write.job_id;
  auto upsert_by_step = [&](const char* sql, const char* what, const auto& items,
                            const auto& to_store) -> absl::Status {
    if (items.empty()) return absl::OkStatus();
    const std::string operation = absl::StrCat("upsert ", what, " for ", job_id);
    for (const auto& item : items) {
      const auto stored = to_store(item);
      ASSIGN_OR_RETURN(Statement upsert, writer.Prepare(sql, operation));
      upsert.BindText(1, job_id);
      upsert.Bind(2, stored.step());
      upsert.BindMessage(3, stored);
      RETURN_IF_ERROR(upsert.Run());
    }
    return absl::OkStatus();
  };
  auto as_is = [](const auto& item) { return item; };
  RETURN_IF_ERROR(upsert_by_step(R"sql(
INSERT INTO step_metrics (job_id, step, metrics) VALUES (?1, ?2, ?3)
ON CONFLICT (job_id, step) DO UPDATE SET metrics = excluded.metrics)sql",
                                 "step metrics", write.metrics, as_is));
  if (!write.metrics.empty()) {
    RETURN_IF_ERROR(AdvanceMetricsComplete(writer, job_id, write.metrics));
  }
  RETURN_IF_ERROR(upsert_by_step(R"sql(
INSERT INTO eval_metrics (job_id, step, metrics) VALUES (?1, ?2, ?3)
ON CONFLICT (job_id, step) DO UPDATE SET metrics = excluded.metrics)sql",
                                 "eval metrics", write.evals, as_is));
  // A checkpoint replaces its step's record unless that record is newer or was retired after
  // this checkpoint was created (see JobWrite::checkpoints).
  for (const v1::Checkpoint& checkpoint : write.checkpoints) {
    v1::Checkpoint stored = checkpoint;
    stored.set_job_id(job_id);
    stored.clear_retired_steps();
    const int64_t created = TimeUtil::TimestampToNanoseconds(stored.create_time());
    ASSIGN_OR_RETURN(Statement upsert,
                     writer.Prepare(R"sql(
INSERT INTO checkpoints (job_id, step, checkpoint, create_time_ns, retire_time_ns)
VALUES (?1, ?2, ?3, ?4, NULL)
ON CONFLICT (job_id, step) DO UPDATE SET checkpoint = excluded.checkpoint,
  create_time_ns = excluded.create_time_ns, retire_time_ns = NULL
WHERE (checkpoints.retire_time_ns IS NULL OR checkpoints.retire_time_ns < excluded.create_time_ns)
  AND (checkpoints.create_time_ns IS NULL OR checkpoints.create_time_ns <= excluded.create_time_ns))sql",
                                    absl::StrCat("upsert checkpoint for ", job_id)));
    upsert.BindText(1, job_id);
    upsert.Bind(2, stored.step());
    upsert.BindMessage(3, stored);
    upsert.Bind(4, created);
    RETURN_IF_ERROR(upsert.Run());
  }
  // A retirement applies to the record of a checkpoint created before it; a step without a
  // record gets an empty retired one.
  for (const CheckpointRetirement& retired : write.retired_checkpoints) {
    ASSIGN_OR_RETURN(Statement retire,
                     writer.Prepare(R"sql(
INSERT INTO checkpoints (job_id, step, checkpoint, create_time_ns, retire_time_ns)
VALUES (?1, ?2, ?3, NULL, ?4)
ON CONFLICT (job_id, step) DO UPDATE SET retire_time_ns = excluded.retire_time_ns
WHERE (checkpoints.create_time_ns IS NULL OR checkpoints.create_time_ns <= excluded.retire_time_ns)
  AND (checkpoints.retire_time_ns IS NULL OR checkpoints.retire_time_ns < excluded.retire_time_ns))sql",
                                    absl::StrCat("retire checkpoint of ", job_id)));
    retire.BindText(1, job_id);
    retire.Bind(2, retired.step);
    retire.BindBlob(3, "");
    retire.Bind(4, absl::ToUnixNanos(retired.time));
    RETURN_IF_ERROR(retire.Run());
  }
  return absl::OkStatus();
}

}  // namespace store_internal

absl::StatusOr<std::vector<v1::StepMetrics>> Store::ReadMetrics(const std::string& job_id,
                                                                int64_t from_step,
                                                                int64_t to_step) {
  return ReadStepRange<v1::StepMetrics>(*database_, "step_metrics", job_id, from_step, to_step);
}

absl::StatusOr<std::vector<v1::EvalMetrics>> Store::ReadEvals(const std::string& job_id,
                                                              int64_t from_step, int64_t to_step) {
  return ReadStepRange<v1::EvalMetrics>(*database_, "eval_metrics", job_id, from_step, to_step);
}

absl::StatusOr<int64_t> Store::MetricsCompleteThrough(const std::string& job_id,
                                                      int64_t up_to_step) {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  ASSIGN_OR_RETURN(
      Statement select,
      reader.Prepare("SELECT through_step FROM step_metrics_complete WHERE job_id = ?1",
                     absl::StrCat("read the complete metric steps of ", job_id)));
  select.BindText(1, job_id);
  ASSIGN_OR_RETURN(bool has_row, select.Step());
  const int64_t complete = has_row ? select.ColumnInt64(0) : 0;
  if (up_to_step == 0) return complete;
  return std::max<int64_t>(0, std::min(complete, up_to_step));
}

absl::StatusOr<std::vector<v1::Checkpoint>> Store::ListCheckpoints(const std::string& job_id) {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = absl::StrCat("list checkpoints of ", job_id);
  ASSIGN_OR_RETURN(
      Statement select,
      reader.Prepare(
          "SELECT step, checkpoint FROM checkpoints WHERE job_id = ?1 AND retire_time_ns IS NULL "
          "ORDER BY step DESC",
          operation));
  select.BindText(1, job_id);
  return ReadStepRows<v1::Checkpoint>(select, job_id, "checkpoints");
}

}  // namespace tessera::coordinator
