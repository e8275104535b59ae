// The Store's jobs: the `jobs` table (the job rows, their request ids, the listings and the
// ListJobs page tokens) and the `counters` table of job ids. Store's reads run under a
// Database::ReadLock; the writes (store_tables.h) run on the writer inside a group commit.
#include <iterator>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_database.h"
#include "coordinator/store/store_tables.h"

namespace tessera::coordinator {
namespace {

constexpr char kJobIdCounter[] = "next_job_id";
constexpr char kPageTokenVersion[] = "v1";
constexpr int64_t kMaxJobIdCounter = 0xffffffffLL;

// The non-terminal states, bound as ?1..?4 of the active-job queries.
constexpr v1::JobState kActiveStates[] = {v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                          v1::JOB_STATE_RUNNING, v1::JOB_STATE_RESTARTING,
                                          v1::JOB_STATE_PREEMPTED};

// Nanoseconds since the Unix epoch, saturated; ordering key of jobs.
int64_t TimestampNanos(const google::protobuf::Timestamp& time) {
  constexpr int64_t kNanosPerSecond = 1'000'000'000;
  constexpr int64_t kMaxSeconds = std::numeric_limits<int64_t>::max() / kNanosPerSecond - 1;
  if (time.seconds() > kMaxSeconds) return std::numeric_limits<int64_t>::max();
  if (time.seconds() < -kMaxSeconds) return std::numeric_limits<int64_t>::min();
  return time.seconds() * kNanosPerSecond + time.nanos();
}

std::string EncodePageToken(int64_t create_time_ns, const std::string& job_id) {
  return absl::WebSafeBase64Escape(
      absl::StrCat(kPageTokenVersion, "|", create_time_ns, "|", job_id));
}

struct PageCursor {
  int64_t create_time_ns = 0;
  std::string job_id;
};

absl::StatusOr<PageCursor> DecodePageToken(const std::string& token) {
  std::string decoded;
  if (!absl::WebSafeBase64Unescape(token, &decoded)) {
    return absl::InvalidArgumentError("page_token: not a token returned by ListJobs");
  }
  std::vector<std::string> parts = absl::StrSplit(decoded, absl::MaxSplits('|', 2));
  PageCursor cursor;
  if (parts.size() != 3 || parts[0] != kPageTokenVersion ||
      !absl::SimpleAtoi(parts[1], &cursor.create_time_ns) || parts[2].empty()) {
    return absl::InvalidArgumentError("page_token: not a token returned by ListJobs");
  }
  cursor.job_id = std::move(parts[2]);
  return cursor;
}

// The jobs of (job_id, job) rows, naming the job of a blob that does not parse.
absl::StatusOr<std::vector<v1::Job>> QueryJobs(Statement& statement, absl::string_view operation) {
  std::vector<v1::Job> jobs;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, statement.Step());
    if (!has_row) break;
    const std::string job_id = statement.ColumnText(0);
    RETURN_IF_ERROR(statement.ColumnMessage(
        1, jobs.emplace_back(), absl::StrCat(operation, ": job '", job_id, "' in table jobs")));
  }
  return jobs;
}

}  // namespace

namespace store_internal {

absl::Status UpsertJob(DbConnection& writer, const std::string& job_id, const v1::Job& job,
                       const std::string& request_id) {
  const std::string operation = absl::StrCat("upsert job ", job_id);
  const int64_t create_time_ns = TimestampNanos(job.create_time());
  // An update names only the columns it may change: SQLite rewrites the index entries of every
  // column an UPDATE sets, changed or not. A job's create_time is fixed when it is submitted,
  // so its update leaves create_time_ns (and jobs_by_create_time) alone; the request id is set
  // only when the write carries one. A write that does change create_time is not updated here
  // (the WHERE) and takes the full update below.
  constexpr char kUpsert[] = R"sql(
INSERT INTO jobs (job_id, state, priority, create_time_ns, request_id, job)
VALUES (?1, ?2, ?3, ?4, NULL, ?5)
ON CONFLICT (job_id) DO UPDATE SET
  state = excluded.state,
  priority = excluded.priority,
  job = excluded.job
WHERE jobs.create_time_ns = excluded.create_time_ns)sql";
  constexpr char kUpsertWithRequestId[] = R"sql(
INSERT INTO jobs (job_id, state, priority, create_time_ns, request_id, job)
VALUES (?1, ?2, ?3, ?4, ?6, ?5)
ON CONFLICT (job_id) DO UPDATE SET
  state = excluded.state,
  priority = excluded.priority,
  request_id = excluded.request_id,
  job = excluded.job
WHERE jobs.create_time_ns = excluded.create_time_ns)sql";
  constexpr char kUpdateAll[] = R"sql(
UPDATE jobs SET
  state = ?2,
  priority = ?3,
  create_time_ns = ?4,
  request_id = COALESCE(?6, request_id),
  job = ?5
WHERE job_id = ?1)sql";
  auto run = [&](const char* sql) -> absl::StatusOr<int64_t> {
    ASSIGN_OR_RETURN(Statement statement, writer.Prepare(sql, operation));
    statement.BindText(1, job_id);
    statement.Bind(2, job.state());
    statement.Bind(3, job.spec().priority());
    statement.Bind(4, create_time_ns);
    statement.BindMessage(5, job);
    if (!request_id.empty()) statement.BindText(6, request_id);
    RETURN_IF_ERROR(statement.Run());
    return statement.Changes();
  };
  ASSIGN_OR_RETURN(const int64_t changed, run(request_id.empty() ? kUpsert : kUpsertWithRequestId));
  if (changed > 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(const int64_t updated, run(kUpdateAll));
  if (updated == 0) {
    return absl::InternalError(absl::StrCat("store: ", operation, ": the row was not written"));
  }
  return absl::OkStatus();
}

absl::Status RecordRequestId(DbConnection& writer, const std::string& job_id,
                             const std::string& request_id) {
  const std::string operation = absl::StrCat("record request id of ", job_id);
  ASSIGN_OR_RETURN(Statement update,
                   writer.Prepare("UPDATE jobs SET request_id = ?2 WHERE job_id = ?1", operation));
  update.BindText(1, job_id);
  update.BindText(2, request_id);
  return update.Run();
}

absl::StatusOr<bool> JobExists(DbConnection& connection, const std::string& job_id) {
  const std::string operation = absl::StrCat("look up job ", job_id);
  ASSIGN_OR_RETURN(Statement select,
                   connection.Prepare("SELECT 1 FROM jobs WHERE job_id = ?1", operation));
  select.BindText(1, job_id);
  return select.Step();
}

absl::StatusOr<std::string> AllocateJobId(DbConnection& writer) {
  const std::string operation = "allocate job id";
  // counters.value, not value: PostgreSQL finds the bare name ambiguous with excluded.value.
  constexpr char kNextValue[] = R"sql(
INSERT INTO counters (name, value) VALUES (?1, 1)
ON CONFLICT (name) DO UPDATE SET value = counters.value + 1
RETURNING value)sql";
  // Skips ids taken by jobs stored under another scheme (none today).
  while (true) {
    int64_t value = 0;
    {
      ASSIGN_OR_RETURN(Statement next, writer.Prepare(kNextValue, operation));
      next.BindText(1, kJobIdCounter);
      ASSIGN_OR_RETURN(bool has_row, next.Step());
      if (!has_row) return absl::InternalError("store: allocate job id: no counter value");
      value = next.ColumnInt64(0);
      // RETURNING rows are produced before the statement completes.
      RETURN_IF_ERROR(next.Run());
    }
    if (value > kMaxJobIdCounter) {
      return absl::ResourceExhaustedError("store: allocate job id: all 2^32-1 job ids are used");
    }
    std::string job_id = absl::StrFormat("job-%08x", value);
    ASSIGN_OR_RETURN(bool taken, JobExists(writer, job_id));
    if (!taken) return job_id;
  }
}

}  // namespace store_internal

absl::StatusOr<v1::Job> Store::GetJob(const std::string& job_id) {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = absl::StrCat("get job ", job_id);
  ASSIGN_OR_RETURN(Statement select,
                   reader.Prepare("SELECT job_id, job FROM jobs WHERE job_id = ?1", operation));
  select.BindText(1, job_id);
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, QueryJobs(select, operation));
  if (jobs.empty()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  return std::move(jobs.front());
}

absl::StatusOr<std::optional<v1::Job>> Store::FindJobByRequestId(const std::string& request_id) {
  if (request_id.empty()) return std::nullopt;
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = absl::StrCat("find job by request id '", request_id, "'");
  ASSIGN_OR_RETURN(Statement select,
                   reader.Prepare("SELECT job_id, job FROM jobs WHERE request_id = ?1", operation));
  select.BindText(1, request_id);
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, QueryJobs(select, operation));
  if (jobs.empty()) return std::nullopt;
  return std::move(jobs.front());
}

absl::StatusOr<JobPage> Store::ListJobs(const std::vector<v1::JobState>& states, int page_size,
                                        const std::string& page_token) {
  if (page_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_size: ", page_size, " is negative"));
  }
  if (page_size == 0) page_size = kDefaultPageSize;
  if (page_size > kMaxPageSize) page_size = kMaxPageSize;
  int64_t state_mask = 0;
  for (size_t i = 0; i < states.size(); ++i) {
    if (states[i] < 0 || states[i] > 62) {
      return absl::InvalidArgumentError(
          absl::StrCat("states[", i, "]: ", static_cast<int>(states[i]), " is not a job state"));
    }
    state_mask |= int64_t{1} << states[i];
  }
  PageCursor cursor;
  if (!page_token.empty()) {
    ASSIGN_OR_RETURN(cursor, DecodePageToken(page_token));
  }

  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "list jobs";
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT job_id, job, create_time_ns FROM jobs
WHERE (?1 = 0 OR ((CAST(1 AS BIGINT) << CAST(state AS INTEGER)) & ?1) != 0)
  AND (?2 = 0 OR create_time_ns < ?3 OR (create_time_ns = ?3 AND job_id < ?4))
ORDER BY create_time_ns DESC, job_id DESC
LIMIT ?5)sql",
                                                    operation));
  select.Bind(1, state_mask);
  select.Bind(2, page_token.empty() ? 0 : 1);
  select.Bind(3, cursor.create_time_ns);
  select.BindText(4, cursor.job_id);
  select.Bind(5, page_size + 1);
  JobPage page;
  int64_t last_create_time_ns = 0;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    if (static_cast<int>(page.jobs.size()) == page_size) {
      page.next_page_token = EncodePageToken(last_create_time_ns, page.jobs.back().job_id());
      break;
    }
    const std::string job_id = select.ColumnText(0);
    v1::Job& job = page.jobs.emplace_back();
    RETURN_IF_ERROR(select.ColumnMessage(
        1, job, absl::StrCat(operation, ": job '", job_id, "' in table jobs")));
    // The row's key, not the blob's, so the cursor matches the index.
    job.set_job_id(job_id);
    last_create_time_ns = select.ColumnInt64(2);
  }
  return page;
}

absl::StatusOr<std::vector<v1::Job>> Store::ListActiveJobs() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "list active jobs";
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT job_id, job FROM jobs WHERE state IN (?1, ?2, ?3, ?4, ?5)
ORDER BY create_time_ns, job_id)sql",
                                                    operation));
  for (int i = 0; i < static_cast<int>(std::size(kActiveStates)); ++i) {
    select.Bind(i + 1, kActiveStates[i]);
  }
  return QueryJobs(select, operation);
}

absl::StatusOr<std::vector<Store::JobSummary>> Store::ListActiveJobSummaries() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "list active job summaries";
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT job_id, state, create_time_ns FROM jobs WHERE state IN (?1, ?2, ?3, ?4, ?5)
ORDER BY create_time_ns, job_id)sql",
                                                    operation));
  for (int i = 0; i < static_cast<int>(std::size(kActiveStates)); ++i) {
    select.Bind(i + 1, kActiveStates[i]);
  }
  std::vector<JobSummary> jobs;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    JobSummary& job = jobs.emplace_back();
    job.job_id = select.ColumnText(0);
    job.state = static_cast<v1::JobState>(select.ColumnInt64(1));
    job.create_time_ns = select.ColumnInt64(2);
  }
  return jobs;
}

absl::StatusOr<std::vector<v1::Job>> Store::ListWaitingJobs() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "list waiting jobs";
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT job_id, job FROM jobs WHERE state IN (?1, ?2)
ORDER BY create_time_ns, job_id)sql",
                                                    operation));
  select.Bind(1, v1::JOB_STATE_PENDING);
  select.Bind(2, v1::JOB_STATE_RESTARTING);
  return QueryJobs(select, operation);
}

absl::StatusOr<std::map<v1::JobState, int64_t>> Store::CountEndedJobs() {
  Database::ReadLock lock(*database_);
  DbConnection& reader = lock.connection();
  const std::string operation = "count ended jobs";
  ASSIGN_OR_RETURN(Statement select, reader.Prepare(R"sql(
SELECT state, COUNT(*) FROM jobs WHERE state IN (?1, ?2, ?3) GROUP BY state)sql",
                                                    operation));
  std::map<v1::JobState, int64_t> counts;
  for (v1::JobState state :
       {v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    select.Bind(static_cast<int>(counts.size()) + 1, state);
    counts[state] = 0;
  }
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    counts[static_cast<v1::JobState>(select.ColumnInt64(0))] = select.ColumnInt64(1);
  }
  return counts;
}

absl::StatusOr<std::string> Store::NextJobId() {
  std::string job_id;
  Database::QueuedWrite write;
  write.apply = [&job_id](DbConnection& writer) -> absl::Status {
    ASSIGN_OR_RETURN(job_id, store_internal::AllocateJobId(writer));
    return absl::OkStatus();
  };
  database_->GroupCommit({&write});
  RETURN_IF_ERROR(write.status);
  return job_id;
}

}  // namespace tessera::coordinator
