#include "coordinator/store.h"

#include <sqlite3.h>
#include <time.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace tessera::coordinator {
namespace {

// Schema migrations: kMigrations[v - 1] takes the schema from version v - 1 to
// v. Append only; never edit a migration that has shipped.
constexpr const char* kMigrations[] = {
    // v1.
    R"sql(
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
)sql",
    // v2: jobs in a rowid table. A WITHOUT ROWID table keeps its rows in the primary key's
    // b-tree, where a row of more than about 1 KB (a serialized Job is 1-3 KB) spills onto
    // overflow pages, and every rewrite of a job (5-6 in its life) rewrote those. Runs with
    // foreign keys off (Store::Migrate): dropping the old table then deletes nothing through
    // the other tables' ON DELETE CASCADE, and their REFERENCES jobs name the new one.
    R"sql(
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
    // v3: a write's events in one row. last_sequence NULL: the row holds the one event
    // `sequence` (every row before v3); otherwise it holds the events sequence..last_sequence,
    // its blob their JobEvents one after another, each prefixed with its size as a varint (a
    // report of 10 metric points was 10 rows, about 2.5 us of the store's single writer each).
    R"sql(
ALTER TABLE job_events ADD COLUMN last_sequence INTEGER;
)sql",
};
static_assert(std::size(kMigrations) == Store::kSchemaVersion);

constexpr char kJobIdCounter[] = "next_job_id";
constexpr char kPageTokenVersion[] = "v1";
constexpr int64_t kMaxJobIdCounter = 0xffffffffLL;

absl::Status SqliteStatus(sqlite3* db, int rc, absl::string_view operation) {
  const char* detail = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
  std::string message = absl::StrCat("store: ", operation, ": ", detail);
  switch (rc & 0xff) {
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return absl::UnavailableError(message);
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(message);
    case SQLITE_CORRUPT:
      return absl::DataLossError(message);
    case SQLITE_NOTADB:
    case SQLITE_CANTOPEN:
      return absl::FailedPreconditionError(message);
    case SQLITE_CONSTRAINT:
      if (rc == SQLITE_CONSTRAINT_UNIQUE || rc == SQLITE_CONSTRAINT_PRIMARYKEY) {
        return absl::AlreadyExistsError(message);
      }
      return absl::InternalError(message);
    default:
      return absl::InternalError(message);
  }
}

// Nanoseconds since the Unix epoch, saturated; ordering key of jobs.
int64_t TimestampNanos(const google::protobuf::Timestamp& time) {
  constexpr int64_t kNanosPerSecond = 1'000'000'000;
  constexpr int64_t kMaxSeconds = std::numeric_limits<int64_t>::max() / kNanosPerSecond - 1;
  if (time.seconds() > kMaxSeconds) return std::numeric_limits<int64_t>::max();
  if (time.seconds() < -kMaxSeconds) return std::numeric_limits<int64_t>::min();
  return time.seconds() * kNanosPerSecond + time.nanos();
}

void SetNow(google::protobuf::Timestamp& time) {
  const absl::Duration since_epoch = absl::Now() - absl::UnixEpoch();
  const int64_t seconds = absl::ToInt64Seconds(since_epoch);
  time.set_seconds(seconds);
  time.set_nanos(
      static_cast<int32_t>(absl::ToInt64Nanoseconds(since_epoch - absl::Seconds(seconds))));
}

// The blob of a job_events row holding several events (schema v3): each event's size as a
// varint32, then the event.
std::string EncodeEvents(const std::vector<v1::JobEvent>& events) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    for (const v1::JobEvent& event : events) {
      coded.WriteVarint32(static_cast<uint32_t>(event.ByteSizeLong()));
      event.SerializeWithCachedSizes(&coded);
    }
  }
  return out;
}

// Appends the events of such a blob to `events`; false when it does not parse.
bool DecodeEvents(absl::string_view blob, std::vector<v1::JobEvent>& events) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(blob.data()),
                                            static_cast<int>(blob.size()));
  while (in.CurrentPosition() < static_cast<int>(blob.size())) {
    uint32_t length = 0;
    if (!in.ReadVarint32(&length)) return false;
    const auto limit = in.PushLimit(static_cast<int>(length));
    if (!events.emplace_back().ParseFromCodedStream(&in) || !in.ConsumedEntireMessage()) {
      return false;
    }
    in.PopLimit(limit);
  }
  return true;
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

}  // namespace

// A prepared statement borrowed from the cache for one use: bind, step, read
// columns; reset and unbound when it goes out of scope.
class Store::Statement {
 public:
  Statement(sqlite3* db, sqlite3_stmt* stmt, absl::string_view operation)
      : db_(db), stmt_(stmt), operation_(operation) {}
  ~Statement() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  // Parameters are numbered from 1. A failed bind is reported by Step.
  void Bind(int index, int64_t value) { Check(sqlite3_bind_int64(stmt_, index, value)); }
  void BindText(int index, absl::string_view value) {
    Check(sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()),
                            SQLITE_TRANSIENT));
  }
  // Empty text binds NULL.
  void BindTextOrNull(int index, absl::string_view value) {
    if (value.empty()) {
      Check(sqlite3_bind_null(stmt_, index));
    } else {
      BindText(index, value);
    }
  }
  void BindBlob(int index, absl::string_view bytes) {
    Check(sqlite3_bind_blob(stmt_, index, bytes.data(), static_cast<int>(bytes.size()),
                            SQLITE_TRANSIENT));
  }
  void BindMessage(int index, const google::protobuf::MessageLite& message) {
    BindBlob(index, message.SerializeAsString());
  }

  // True when a row is ready, false when done.
  absl::StatusOr<bool> Step() {
    if (bind_rc_ != SQLITE_OK) return SqliteStatus(db_, bind_rc_, operation_);
    const int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    return SqliteStatus(db_, rc, operation_);
  }
  // Steps a statement that returns no rows.
  absl::Status Run() {
    ASSIGN_OR_RETURN(bool row, Step());
    (void)row;
    return absl::OkStatus();
  }

  int64_t ColumnInt64(int column) { return sqlite3_column_int64(stmt_, column); }
  bool ColumnIsNull(int column) { return sqlite3_column_type(stmt_, column) == SQLITE_NULL; }
  // The column's bytes, valid until the next Step.
  absl::string_view ColumnBytes(int column) {
    const void* data = sqlite3_column_blob(stmt_, column);
    return {static_cast<const char*>(data),
            static_cast<size_t>(sqlite3_column_bytes(stmt_, column))};
  }
  std::string ColumnText(int column) {
    const unsigned char* text = sqlite3_column_text(stmt_, column);
    return text == nullptr ? std::string()
                           : std::string(reinterpret_cast<const char*>(text),
                                         sqlite3_column_bytes(stmt_, column));
  }
  // DATA_LOSS naming `what` when the blob does not parse.
  absl::Status ColumnMessage(int column, google::protobuf::MessageLite& message,
                             absl::string_view what) {
    const absl::string_view bytes = ColumnBytes(column);
    if (!message.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
      return absl::DataLossError(absl::StrCat("store: ", what, ": stored ", message.GetTypeName(),
                                              " (", bytes.size(), " bytes) does not parse"));
    }
    return absl::OkStatus();
  }

 private:
  void Check(int rc) {
    if (rc != SQLITE_OK && bind_rc_ == SQLITE_OK) bind_rc_ = rc;
  }

  sqlite3* const db_;
  sqlite3_stmt* const stmt_;
  const absl::string_view operation_;
  int bind_rc_ = SQLITE_OK;
};

namespace {

// How many read-only connections a file database gets: one per core, at most 4. SQLite's WAL
// index has 5 read marks (one for a fully checkpointed database, 4 for snapshots); with at most
// 4 readers every open read transaction can hold a mark of its own, so none waits for one.
int ReaderCount() {
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
}

// CPU time of the calling thread, in seconds (0 where the clock cannot be read).
double ThreadCpuSeconds() {
  timespec now{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now) != 0) return 0;
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// `sql` prepared on `db`, from `cache` when it was prepared before (the caller holds the
// connection's mutex).
absl::StatusOr<sqlite3_stmt*> PrepareCached(
    sqlite3* db, absl::flat_hash_map<std::string, sqlite3_stmt*>& cache, absl::string_view sql,
    absl::string_view operation) {
  if (auto it = cache.find(sql); it != cache.end()) return it->second;
  sqlite3_stmt* stmt = nullptr;
  const int rc = sqlite3_prepare_v3(db, sql.data(), static_cast<int>(sql.size()),
                                    SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(db, rc, operation);
  cache.emplace(std::string(sql), stmt);
  return stmt;
}

}  // namespace

struct Store::Reader {
  sqlite3* db = nullptr;
  absl::flat_hash_map<std::string, sqlite3_stmt*> statements;
};

class Store::ReadLock {
 public:
  explicit ReadLock(Store* store) ABSL_NO_THREAD_SAFETY_ANALYSIS : store_(store) {
    if (store->readers_.empty()) {
      store->mu_.Lock();
      return;
    }
    absl::MutexLock lock(&store->read_mu_);
    store->read_mu_.Await(absl::Condition(
        +[](std::vector<Reader*>* idle) { return !idle->empty(); }, &store->idle_readers_));
    reader_ = store->idle_readers_.back();
    store->idle_readers_.pop_back();
  }
  ~ReadLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (reader_ == nullptr) {
      store_->mu_.Unlock();
      return;
    }
    absl::MutexLock lock(&store_->read_mu_);
    store_->idle_readers_.push_back(reader_);
  }
  ReadLock(const ReadLock&) = delete;
  ReadLock& operator=(const ReadLock&) = delete;

  sqlite3* db() const { return reader_ != nullptr ? reader_->db : store_->db_; }

  absl::StatusOr<sqlite3_stmt*> Prepare(absl::string_view sql, absl::string_view operation)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (reader_ == nullptr) return store_->Prepare(sql, operation);
    return PrepareCached(reader_->db, reader_->statements, sql, operation);
  }

 private:
  Store* const store_;
  Reader* reader_ = nullptr;  // null: db_, under mu_
};

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status = SqliteStatus(db, rc, absl::StrCat("open '", path, "'"));
    sqlite3_close(db);
    return status;
  }
  std::unique_ptr<Store> store(new Store(db, path));
  {
    absl::MutexLock lock(&store->mu_);
    RETURN_IF_ERROR(store->Configure());
  }
  if (path != ":memory:") {
    for (int i = 0; i < ReaderCount(); ++i) {
      auto reader = std::make_unique<Reader>();
      const int read_rc = sqlite3_open_v2(path.c_str(), &reader->db,
                                          SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, nullptr);
      // Closed by ~Store (with the others) from here on, whatever follows.
      store->readers_.push_back(std::move(reader));
      sqlite3* db = store->readers_.back()->db;
      if (read_rc != SQLITE_OK) {
        return SqliteStatus(db, read_rc, absl::StrCat("open '", path, "' for reading"));
      }
      sqlite3_extended_result_codes(db, 1);
      if (const int busy_rc = sqlite3_busy_timeout(db, kBusyTimeoutMs); busy_rc != SQLITE_OK) {
        return SqliteStatus(db, busy_rc, absl::StrCat("open '", path, "' for reading"));
      }
    }
    absl::MutexLock lock(&store->read_mu_);
    for (auto& reader : store->readers_) store->idle_readers_.push_back(reader.get());
  }
  return store;
}

Store::Store(sqlite3* db, std::string path) : path_(std::move(path)), db_(db) {}

Store::~Store() {
  for (auto& reader : readers_) {
    for (auto& [sql, stmt] : reader->statements) sqlite3_finalize(stmt);
    sqlite3_close(reader->db);  // a no-op for a null handle
  }
  absl::MutexLock lock(&mu_);
  for (auto& [sql, stmt] : statements_) sqlite3_finalize(stmt);
  sqlite3_close(db_);
}

absl::Status Store::Configure() {
  const std::string operation = absl::StrCat("open '", path_, "'");
  sqlite3_extended_result_codes(db_, 1);
  if (const int rc = sqlite3_busy_timeout(db_, kBusyTimeoutMs); rc != SQLITE_OK) {
    return SqliteStatus(db_, rc, operation);
  }
  // The first statement reads the file: a file that is not a database fails
  // here with SQLITE_NOTADB.
  std::string mode;
  {
    // Reset before Migrate: a table cannot be dropped while a statement is open.
    ASSIGN_OR_RETURN(sqlite3_stmt * journal_mode_stmt,
                     Prepare("PRAGMA journal_mode = WAL", operation));
    Statement journal_mode(db_, journal_mode_stmt, operation);
    ASSIGN_OR_RETURN(bool has_row, journal_mode.Step());
    if (has_row) mode = journal_mode.ColumnText(0);
  }
  if (mode != "wal" && !(mode == "memory" && path_ == ":memory:")) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: ", operation, ": journal_mode is '", mode, "', want 'wal'"));
  }
  RETURN_IF_ERROR(Exec("PRAGMA synchronous = FULL", operation));
  // Pragmas ignore what they do not understand; read the settings back, since
  // durability and referential integrity rest on them.
  constexpr int64_t kSynchronousFull = 2;
  RETURN_IF_ERROR(ExpectPragma("PRAGMA synchronous", kSynchronousFull, operation));
  // Foreign keys go on after the migrations (Migrate), which rebuild tables with them off.
  RETURN_IF_ERROR(Exec("PRAGMA foreign_keys = OFF", operation));
  RETURN_IF_ERROR(Migrate());
  RETURN_IF_ERROR(Exec("PRAGMA foreign_keys = ON", operation));
  return ExpectPragma("PRAGMA foreign_keys", 1, operation);
}

absl::Status Store::ExpectPragma(const char* pragma, int64_t want, absl::string_view operation) {
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(pragma, operation));
  Statement read(db_, stmt, operation);
  ASSIGN_OR_RETURN(bool has_row, read.Step());
  const int64_t got = has_row ? read.ColumnInt64(0) : -1;
  if (got != want) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: ", operation, ": ", pragma, " is ", got, ", want ", want));
  }
  return absl::OkStatus();
}

absl::Status Store::Migrate() {
  const std::string operation = absl::StrCat("migrate '", path_, "'");
  RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", operation));
  absl::Status status = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    RETURN_IF_ERROR(
        Exec("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)", operation));
    int64_t version = 0;
    {
      // Reset before the migrations run: a table cannot be dropped while a read is open.
      ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                       Prepare("SELECT COALESCE(MAX(version), 0) FROM schema_version", operation));
      Statement select(db_, stmt, operation);
      ASSIGN_OR_RETURN(bool has_row, select.Step());
      if (has_row) version = select.ColumnInt64(0);
    }
    if (version > kSchemaVersion) {
      return absl::FailedPreconditionError(absl::StrCat("store: '", path_, "' has schema version ",
                                                        version, ", newer than this binary's ",
                                                        kSchemaVersion));
    }
    for (int64_t next = version + 1; next <= kSchemaVersion; ++next) {
      RETURN_IF_ERROR(
          Exec(kMigrations[next - 1], absl::StrCat(operation, " to schema version ", next)));
    }
    if (version != kSchemaVersion) {
      // The migrations ran with foreign keys off: check what they left before committing it.
      ASSIGN_OR_RETURN(sqlite3_stmt * check_stmt, Prepare("PRAGMA foreign_key_check", operation));
      Statement check(db_, check_stmt, operation);
      ASSIGN_OR_RETURN(bool violated, check.Step());
      if (violated) {
        return absl::DataLossError(absl::StrCat("store: ", operation, ": a row of ",
                                                check.ColumnText(0), " refers to a missing row of ",
                                                check.ColumnText(2)));
      }
      RETURN_IF_ERROR(Exec("DELETE FROM schema_version", operation));
      ASSIGN_OR_RETURN(sqlite3_stmt * insert_stmt,
                       Prepare("INSERT INTO schema_version (version) VALUES (?1)", operation));
      Statement insert(db_, insert_stmt, operation);
      insert.Bind(1, kSchemaVersion);
      RETURN_IF_ERROR(insert.Run());
    }
    return absl::OkStatus();
  }();
  return FinishTransaction(std::move(status), operation);
}

absl::StatusOr<sqlite3_stmt*> Store::Prepare(absl::string_view sql, absl::string_view operation) {
  return PrepareCached(db_, statements_, sql, operation);
}

absl::Status Store::Exec(const char* sql, absl::string_view operation) {
  const int rc = sqlite3_exec(db_, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(db_, rc, operation);
  return absl::OkStatus();
}

absl::Status Store::Run(absl::string_view sql, absl::string_view operation) {
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(sql, operation));
  Statement statement(db_, stmt, operation);
  return statement.Run();
}

absl::Status Store::FinishTransaction(absl::Status status, absl::string_view operation) {
  if (status.ok()) {
    status = Run("COMMIT", operation);
    if (status.ok()) return status;
  }
  // Some errors (SQLITE_FULL, SQLITE_IOERR) roll back by themselves.
  if (sqlite3_get_autocommit(db_) == 0) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  return status;
}

absl::Status Store::CheckWrite(const JobWrite& write) {
  if (write.job_id.empty()) return absl::InvalidArgumentError("store: job_id is empty");
  RETURN_IF_ERROR(InjectedFailure(write.job_id));
  if (write.job.has_value() && write.job->job_id() != write.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("store: job.job_id '", write.job->job_id(),
                                                   "' does not match job_id '", write.job_id, "'"));
  }
  for (size_t i = 0; i < write.events.size(); ++i) {
    const std::string& event_job = write.events[i].job_id();
    if (!event_job.empty() && event_job != write.job_id) {
      return absl::InvalidArgumentError(absl::StrCat("store: events[", i, "].job_id '", event_job,
                                                     "' does not match job_id '", write.job_id,
                                                     "'"));
    }
  }
  for (size_t i = 0; i < write.checkpoints.size(); ++i) {
    const std::string& checkpoint_job = write.checkpoints[i].job_id();
    if (!checkpoint_job.empty() && checkpoint_job != write.job_id) {
      return absl::InvalidArgumentError(absl::StrCat("store: checkpoints[", i, "].job_id '",
                                                     checkpoint_job, "' does not match job_id '",
                                                     write.job_id, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::JobEvent>> Store::Commit(const JobWrite& write) {
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results = CommitAll({write});
  return std::move(results.front());
}

std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> Store::CommitAll(
    const std::vector<JobWrite>& writes) {
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results(writes.size());
  std::vector<std::vector<v1::JobEvent>> stored_events(writes.size());
  std::vector<QueuedWrite> queued(writes.size());
  std::vector<QueuedWrite*> to_commit;
  for (size_t i = 0; i < writes.size(); ++i) {
    if (absl::Status checked = CheckWrite(writes[i]); !checked.ok()) {
      results[i] = std::move(checked);
      continue;
    }
    queued[i].apply = [this, &write = writes[i], &events = stored_events[i]]()
                          ABSL_NO_THREAD_SAFETY_ANALYSIS { return ApplyWrite(write, events); };
    to_commit.push_back(&queued[i]);
  }
  GroupCommit(to_commit);
  for (size_t i = 0; i < writes.size(); ++i) {
    if (!queued[i].apply) continue;
    if (queued[i].status.ok()) {
      results[i] = std::move(stored_events[i]);
    } else {
      results[i] = std::move(queued[i].status);
    }
  }
  return results;
}

void Store::GroupCommit(const std::vector<QueuedWrite*>& writes) {
  if (writes.empty()) return;
  absl::MutexLock lock(&queue_mu_);
  queued_.insert(queued_.end(), writes.begin(), writes.end());
  // Ours are done once the last one is (a batch is finished as a whole).
  QueuedWrite* const first = writes.front();
  QueuedWrite* const last = writes.back();
  // Wakes when ours are done, or when no commit is under way and ours head the queue: then this
  // caller leads the next batch. Only that one caller wakes to lead, and the others only once
  // their writes are done (a condition variable woke every waiter after every batch).
  struct Turn {
    Store* store;
    QueuedWrite* first;
    QueuedWrite* last;
    static bool Ready(Turn* turn) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return turn->last->done || (!turn->store->committing_ && !turn->store->queued_.empty() &&
                                  turn->store->queued_.front() == turn->first);
    }
  } turn{this, first, last};
  while (true) {
    queue_mu_.Await(absl::Condition(&Turn::Ready, &turn));
    if (last->done) break;
    committing_ = true;
    std::vector<QueuedWrite*> batch = std::move(queued_);
    queued_.clear();
    queue_mu_.Unlock();
    const StoreWriteStats stats = RunBatch(batch);
    const bool any_applied =
        std::any_of(batch.begin(), batch.end(), [](const QueuedWrite* w) { return w->status.ok(); });
    if (any_applied) ReportWrite(stats);
    queue_mu_.Lock();
    for (QueuedWrite* write : batch) write->done = true;
    committing_ = false;
  }
}

StoreWriteStats Store::RunBatch(const std::vector<QueuedWrite*>& batch) {
  absl::MutexLock lock(&mu_);
  const absl::Time start = absl::Now();
  const double cpu_start = ThreadCpuSeconds();
  const std::string operation = absl::StrCat("group commit of ", batch.size(), " writes");
  auto finished = [&] {
    return StoreWriteStats{.seconds = absl::ToDoubleSeconds(absl::Now() - start),
                           .cpu_seconds = ThreadCpuSeconds() - cpu_start,
                           .writes = static_cast<int>(batch.size())};
  };
  absl::Status begun = Run("BEGIN IMMEDIATE", operation);
  if (!begun.ok()) {
    for (QueuedWrite* write : batch) write->status = begun;
    return {};
  }
  // First the whole batch without a savepoint per write: nearly every batch applies whole, and
  // SAVEPOINT + RELEASE for each write were about a tenth of the writer's CPU. When a write fails,
  // the transaction is rolled back and the batch applied again with a savepoint for each write
  // (below), so that only the failing write's caller sees its error.
  absl::Status failed;
  for (QueuedWrite* write : batch) {
    failed = write->apply();
    if (!failed.ok()) break;
  }
  if (failed.ok()) {
    const absl::Status committed = FinishTransaction(absl::OkStatus(), operation);
    for (QueuedWrite* write : batch) write->status = committed;
    return committed.ok() ? finished() : StoreWriteStats{};
  }
  if (sqlite3_get_autocommit(db_) == 0) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  if (batch.size() == 1) {
    batch.front()->status = std::move(failed);
    return {};
  }
  begun = Run("BEGIN IMMEDIATE", operation);
  if (!begun.ok()) {
    for (QueuedWrite* write : batch) write->status = begun;
    return {};
  }
  for (QueuedWrite* write : batch) {
    absl::Status status = Run("SAVEPOINT write", operation);
    if (status.ok()) status = write->apply();
    if (status.ok()) {
      status = Run("RELEASE write", operation);
    } else if (sqlite3_get_autocommit(db_) == 0) {
      sqlite3_exec(db_, "ROLLBACK TO write", nullptr, nullptr, nullptr);
      sqlite3_exec(db_, "RELEASE write", nullptr, nullptr, nullptr);
    }
    write->status = std::move(status);
    if (sqlite3_get_autocommit(db_) != 0) {
      // SQLite rolled the whole transaction back (SQLITE_FULL, SQLITE_IOERR): nothing of the
      // batch is stored, and the writes after this one were never tried.
      const absl::Status lost =
          write->status.ok() ? absl::InternalError(absl::StrCat("store: ", operation,
                                                                ": transaction rolled back"))
                             : write->status;
      for (QueuedWrite* other : batch) other->status = lost;
      return {};
    }
  }
  absl::Status committed = FinishTransaction(absl::OkStatus(), operation);
  if (!committed.ok()) {
    for (QueuedWrite* write : batch) {
      if (write->status.ok()) write->status = committed;
    }
  }
  return finished();
}

absl::Status Store::UpsertJob(const std::string& job_id, const v1::Job& job,
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
WHERE create_time_ns = excluded.create_time_ns)sql";
  constexpr char kUpsertWithRequestId[] = R"sql(
INSERT INTO jobs (job_id, state, priority, create_time_ns, request_id, job)
VALUES (?1, ?2, ?3, ?4, ?6, ?5)
ON CONFLICT (job_id) DO UPDATE SET
  state = excluded.state,
  priority = excluded.priority,
  request_id = excluded.request_id,
  job = excluded.job
WHERE create_time_ns = excluded.create_time_ns)sql";
  constexpr char kUpdateAll[] = R"sql(
UPDATE jobs SET
  state = ?2,
  priority = ?3,
  create_time_ns = ?4,
  request_id = COALESCE(?6, request_id),
  job = ?5
WHERE job_id = ?1)sql";
  auto run = [&](const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<int> {
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(sql, operation));
    Statement statement(db_, stmt, operation);
    statement.BindText(1, job_id);
    statement.Bind(2, job.state());
    statement.Bind(3, job.spec().priority());
    statement.Bind(4, create_time_ns);
    statement.BindMessage(5, job);
    if (!request_id.empty()) statement.BindText(6, request_id);
    RETURN_IF_ERROR(statement.Run());
    return sqlite3_changes(db_);
  };
  ASSIGN_OR_RETURN(const int changed, run(request_id.empty() ? kUpsert : kUpsertWithRequestId));
  if (changed > 0) return absl::OkStatus();
  ASSIGN_OR_RETURN(const int updated, run(kUpdateAll));
  if (updated == 0) {
    return absl::InternalError(absl::StrCat("store: ", operation, ": the row was not written"));
  }
  return absl::OkStatus();
}

absl::Status Store::ApplyWrite(const JobWrite& write, std::vector<v1::JobEvent>& stored_events) {
  // A batch whose other write failed applies this one again (RunBatch).
  stored_events.clear();
  const std::string& job_id = write.job_id;
  if (write.job.has_value()) {
    RETURN_IF_ERROR(UpsertJob(job_id, *write.job, write.request_id));
  } else {
    ASSIGN_OR_RETURN(bool exists, JobExists(job_id));
    if (!exists) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    if (!write.request_id.empty()) {
      const std::string operation = absl::StrCat("record request id of ", job_id);
      ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                       Prepare("UPDATE jobs SET request_id = ?2 WHERE job_id = ?1", operation));
      Statement update(db_, stmt, operation);
      update.BindText(1, job_id);
      update.BindText(2, write.request_id);
      RETURN_IF_ERROR(update.Run());
    }
  }

  if (!write.events.empty()) {
    const std::string read = absl::StrCat("read last event sequence of ", job_id);
    ASSIGN_OR_RETURN(int64_t sequence,
                     LastSequence(
                         db_,
                         [&](absl::string_view sql)
                             ABSL_NO_THREAD_SAFETY_ANALYSIS { return Prepare(sql, read); },
                         job_id, read));
    const int64_t first = sequence + 1;
    stored_events.reserve(write.events.size());
    for (const v1::JobEvent& event : write.events) {
      v1::JobEvent& stored = stored_events.emplace_back(event);
      stored.set_job_id(job_id);
      stored.set_sequence(++sequence);
      if (!stored.has_time()) SetNow(*stored.mutable_time());
    }
    // One row for the write's events (schema v3).
    const std::string operation = absl::StrCat("insert events for ", job_id);
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(R"sql(
INSERT INTO job_events (job_id, sequence, last_sequence, event) VALUES (?1, ?2, ?3, ?4))sql",
                                                  operation));
    Statement insert(db_, stmt, operation);
    insert.BindText(1, job_id);
    insert.Bind(2, first);
    if (stored_events.size() == 1) {
      insert.BindMessage(4, stored_events.front());  // last_sequence NULL: one event
    } else {
      insert.Bind(3, sequence);
      insert.BindBlob(4, EncodeEvents(stored_events));
    }
    RETURN_IF_ERROR(insert.Run());
  }

  // Metric points, evaluations and checkpoint records are keyed (job_id,
  // step); a resent step replaces the old row.
  auto upsert_by_step = [&](const char* sql, const char* what, const auto& items,
                            const auto& to_store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)
                            -> absl::Status {
    if (items.empty()) return absl::OkStatus();
    const std::string operation = absl::StrCat("upsert ", what, " for ", job_id);
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(sql, operation));
    for (const auto& item : items) {
      const auto stored = to_store(item);
      Statement upsert(db_, stmt, operation);
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
  RETURN_IF_ERROR(upsert_by_step(R"sql(
INSERT INTO eval_metrics (job_id, step, metrics) VALUES (?1, ?2, ?3)
ON CONFLICT (job_id, step) DO UPDATE SET metrics = excluded.metrics)sql",
                                 "eval metrics", write.evals, as_is));
  RETURN_IF_ERROR(upsert_by_step(R"sql(
INSERT INTO checkpoints (job_id, step, checkpoint) VALUES (?1, ?2, ?3)
ON CONFLICT (job_id, step) DO UPDATE SET checkpoint = excluded.checkpoint)sql",
                                 "checkpoint", write.checkpoints,
                                 [&](const v1::Checkpoint& checkpoint) {
                                   v1::Checkpoint stored = checkpoint;
                                   stored.set_job_id(job_id);
                                   return stored;
                                 }));

  if (!write.deleted_checkpoint_steps.empty()) {
    const std::string operation = absl::StrCat("delete checkpoint of ", job_id);
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                     Prepare("DELETE FROM checkpoints WHERE job_id = ?1 AND step = ?2", operation));
    for (int64_t step : write.deleted_checkpoint_steps) {
      Statement remove(db_, stmt, operation);
      remove.BindText(1, job_id);
      remove.Bind(2, step);
      RETURN_IF_ERROR(remove.Run());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Store::JobExists(const std::string& job_id) {
  const std::string operation = absl::StrCat("look up job ", job_id);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare("SELECT 1 FROM jobs WHERE job_id = ?1", operation));
  Statement select(db_, stmt, operation);
  select.BindText(1, job_id);
  return select.Step();
}

absl::StatusOr<std::vector<v1::Job>> Store::QueryJobs(Statement& statement,
                                                      absl::string_view operation) {
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

absl::StatusOr<v1::Job> Store::GetJob(const std::string& job_id) {
  ReadLock lock(this);
  const std::string operation = absl::StrCat("get job ", job_id);
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                   lock.Prepare("SELECT job_id, job FROM jobs WHERE job_id = ?1", operation));
  Statement select(lock.db(), stmt, operation);
  select.BindText(1, job_id);
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, QueryJobs(select, operation));
  if (jobs.empty()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
  return std::move(jobs.front());
}

absl::StatusOr<std::optional<v1::Job>> Store::FindJobByRequestId(const std::string& request_id) {
  if (request_id.empty()) return std::nullopt;
  ReadLock lock(this);
  const std::string operation = absl::StrCat("find job by request id '", request_id, "'");
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                   lock.Prepare("SELECT job_id, job FROM jobs WHERE request_id = ?1", operation));
  Statement select(lock.db(), stmt, operation);
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

  ReadLock lock(this);
  const std::string operation = "list jobs";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT job_id, job, create_time_ns FROM jobs
WHERE (?1 = 0 OR ((1 << state) & ?1) != 0)
  AND (?2 = 0 OR create_time_ns < ?3 OR (create_time_ns = ?3 AND job_id < ?4))
ORDER BY create_time_ns DESC, job_id DESC
LIMIT ?5)sql",
                                                operation));
  Statement select(lock.db(), stmt, operation);
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

namespace {
// The non-terminal states, bound as ?1..?4 of the active-job queries.
constexpr v1::JobState kActiveStates[] = {v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                          v1::JOB_STATE_RUNNING, v1::JOB_STATE_RESTARTING};
}  // namespace

absl::StatusOr<std::vector<v1::Job>> Store::ListActiveJobs() {
  ReadLock lock(this);
  const std::string operation = "list active jobs";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT job_id, job FROM jobs WHERE state IN (?1, ?2, ?3, ?4)
ORDER BY create_time_ns, job_id)sql",
                                                operation));
  Statement select(lock.db(), stmt, operation);
  for (int i = 0; i < static_cast<int>(std::size(kActiveStates)); ++i) {
    select.Bind(i + 1, kActiveStates[i]);
  }
  return QueryJobs(select, operation);
}

absl::StatusOr<std::vector<Store::JobSummary>> Store::ListActiveJobSummaries() {
  ReadLock lock(this);
  const std::string operation = "list active job summaries";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT job_id, state, create_time_ns FROM jobs WHERE state IN (?1, ?2, ?3, ?4)
ORDER BY create_time_ns, job_id)sql",
                                                operation));
  Statement select(lock.db(), stmt, operation);
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
  ReadLock lock(this);
  const std::string operation = "list waiting jobs";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT job_id, job FROM jobs WHERE state IN (?1, ?2)
ORDER BY create_time_ns, job_id)sql",
                                                operation));
  Statement select(lock.db(), stmt, operation);
  select.Bind(1, v1::JOB_STATE_PENDING);
  select.Bind(2, v1::JOB_STATE_RESTARTING);
  return QueryJobs(select, operation);
}

absl::StatusOr<std::map<v1::JobState, int64_t>> Store::CountEndedJobs() {
  ReadLock lock(this);
  const std::string operation = "count ended jobs";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT state, COUNT(*) FROM jobs WHERE state IN (?1, ?2, ?3) GROUP BY state)sql",
                                                operation));
  Statement select(lock.db(), stmt, operation);
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

absl::StatusOr<std::vector<v1::JobEvent>> Store::ReadEvents(const std::string& job_id,
                                                            int64_t after_sequence, int limit) {
  ReadLock lock(this);
  const std::string operation = absl::StrCat("read events of ", job_id);
  // From the row that holds event after_sequence + 1 (the last row that starts at or before it).
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, lock.Prepare(R"sql(
SELECT sequence, last_sequence, event FROM job_events
WHERE job_id = ?1 AND sequence >= (
  SELECT COALESCE(MAX(sequence), 0) FROM job_events WHERE job_id = ?1 AND sequence <= ?2 + 1)
ORDER BY sequence)sql",
                                                     operation));
  Statement select(lock.db(), stmt, operation);
  select.BindText(1, job_id);
  select.Bind(2, after_sequence);
  std::vector<v1::JobEvent> events;
  while (limit <= 0 || static_cast<int>(events.size()) < limit) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    const int64_t sequence = select.ColumnInt64(0);
    const std::string what =
        absl::StrCat(operation, ": event ", sequence, " of job '", job_id, "' in table job_events");
    std::vector<v1::JobEvent> row;
    if (select.ColumnIsNull(1)) {
      RETURN_IF_ERROR(select.ColumnMessage(2, row.emplace_back(), what));
    } else if (!DecodeEvents(select.ColumnBytes(2), row)) {
      return absl::DataLossError(absl::StrCat("store: ", what, " (events ", sequence, " to ",
                                              select.ColumnInt64(1), ") does not parse"));
    }
    for (v1::JobEvent& event : row) {
      if (event.sequence() <= after_sequence) continue;
      if (limit > 0 && static_cast<int>(events.size()) >= limit) break;
      events.push_back(std::move(event));
    }
  }
  return events;
}

absl::StatusOr<int64_t> Store::LastEventSequence(const std::string& job_id) {
  ReadLock lock(this);
  const std::string operation = absl::StrCat("read last event sequence of ", job_id);
  return LastSequence(
      lock.db(), [&](absl::string_view sql) { return lock.Prepare(sql, operation); }, job_id,
      operation);
}

absl::StatusOr<int64_t> Store::LastSequence(
    sqlite3* db, absl::FunctionRef<absl::StatusOr<sqlite3_stmt*>(absl::string_view sql)> prepare,
    const std::string& job_id, absl::string_view operation) {
  // The last row's last event (schema v3: a row may hold several).
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, prepare(R"sql(
SELECT COALESCE(last_sequence, sequence) FROM job_events WHERE job_id = ?1
ORDER BY sequence DESC LIMIT 1)sql"));
  Statement select(db, stmt, operation);
  select.BindText(1, job_id);
  ASSIGN_OR_RETURN(bool has_row, select.Step());
  return has_row ? select.ColumnInt64(0) : 0;
}

namespace {

// Reads (step, blob) rows into messages, naming `table` on a bad blob.
template <typename Message, typename Statement>
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

}  // namespace

absl::StatusOr<std::vector<v1::StepMetrics>> Store::ReadMetrics(const std::string& job_id,
                                                                int64_t from_step,
                                                                int64_t to_step) {
  return ReadStepRange<v1::StepMetrics>("step_metrics", job_id, from_step, to_step);
}

absl::StatusOr<std::vector<v1::EvalMetrics>> Store::ReadEvals(const std::string& job_id,
                                                              int64_t from_step, int64_t to_step) {
  return ReadStepRange<v1::EvalMetrics>("eval_metrics", job_id, from_step, to_step);
}

template <typename Message>
absl::StatusOr<std::vector<Message>> Store::ReadStepRange(const char* table,
                                                          const std::string& job_id,
                                                          int64_t from_step, int64_t to_step) {
  ReadLock lock(this);
  const std::string operation = absl::StrCat("read ", table, " of ", job_id);
  // `table` is one of ours, never input: the SQL stays a fixed set of strings.
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                   lock.Prepare(absl::StrCat("SELECT step, metrics FROM ", table,
                                        " WHERE job_id = ?1 AND step >= ?2 AND step <= ?3 "
                                        "ORDER BY step"),
                           operation));
  Statement select(lock.db(), stmt, operation);
  select.BindText(1, job_id);
  select.Bind(2, from_step);
  select.Bind(3, to_step == 0 ? std::numeric_limits<int64_t>::max() : to_step);
  return ReadStepRows<Message>(select, job_id, table);
}

absl::StatusOr<std::vector<v1::Checkpoint>> Store::ListCheckpoints(const std::string& job_id) {
  ReadLock lock(this);
  const std::string operation = absl::StrCat("list checkpoints of ", job_id);
  ASSIGN_OR_RETURN(
      sqlite3_stmt * stmt,
      lock.Prepare("SELECT step, checkpoint FROM checkpoints WHERE job_id = ?1 ORDER BY step DESC",
              operation));
  Statement select(lock.db(), stmt, operation);
  select.BindText(1, job_id);
  return ReadStepRows<v1::Checkpoint>(select, job_id, "checkpoints");
}

absl::Status Store::PutNode(const v1::Node& node) {
  if (node.node_id().empty()) return absl::InvalidArgumentError("store: node.node_id is empty");
  RETURN_IF_ERROR(InjectedFailure(node.node_id()));
  QueuedWrite write;
  write.apply = [this, &node]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    const std::string operation = absl::StrCat("put node ", node.node_id());
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(R"sql(
INSERT INTO nodes (node_id, node) VALUES (?1, ?2)
ON CONFLICT (node_id) DO UPDATE SET node = excluded.node)sql",
                                                  operation));
    Statement upsert(db_, stmt, operation);
    upsert.BindText(1, node.node_id());
    upsert.BindMessage(2, node);
    return upsert.Run();
  };
  GroupCommit({&write});
  return write.status;
}

absl::Status Store::DeleteNode(const std::string& node_id) {
  QueuedWrite write;
  write.apply = [this, &node_id]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    const std::string operation = absl::StrCat("delete node ", node_id);
    ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                     Prepare("DELETE FROM nodes WHERE node_id = ?1", operation));
    Statement remove(db_, stmt, operation);
    remove.BindText(1, node_id);
    return remove.Run();
  };
  GroupCommit({&write});
  return write.status;
}

absl::StatusOr<std::vector<v1::Node>> Store::ListNodes() {
  ReadLock lock(this);
  const std::string operation = "list nodes";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt,
                   lock.Prepare("SELECT node_id, node FROM nodes ORDER BY node_id", operation));
  Statement select(lock.db(), stmt, operation);
  std::vector<v1::Node> nodes;
  while (true) {
    ASSIGN_OR_RETURN(bool has_row, select.Step());
    if (!has_row) break;
    const std::string node_id = select.ColumnText(0);
    RETURN_IF_ERROR(select.ColumnMessage(
        1, nodes.emplace_back(), absl::StrCat(operation, ": node '", node_id, "' in table nodes")));
  }
  return nodes;
}

absl::StatusOr<std::string> Store::AllocateJobIdLocked() {
  const std::string operation = "allocate job id";
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(R"sql(
INSERT INTO counters (name, value) VALUES (?1, 1)
ON CONFLICT (name) DO UPDATE SET value = value + 1
RETURNING value)sql",
                                                operation));
  // Skips ids taken by jobs stored under another scheme (none today).
  while (true) {
    int64_t value = 0;
    {
      Statement next(db_, stmt, operation);
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
    ASSIGN_OR_RETURN(bool taken, JobExists(job_id));
    if (!taken) return job_id;
  }
}

absl::StatusOr<std::string> Store::NextJobId() {
  std::string job_id;
  QueuedWrite write;
  write.apply = [this, &job_id]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    ASSIGN_OR_RETURN(job_id, AllocateJobIdLocked());
    return absl::OkStatus();
  };
  GroupCommit({&write});
  RETURN_IF_ERROR(write.status);
  return job_id;
}

absl::Status Store::CommitNewJob(JobWrite* write) {
  if (!write->job_id.empty() || !write->job.has_value() || !write->job->job_id().empty()) {
    return absl::InvalidArgumentError(
        "store: a new job's write carries a job and no job_id (the store assigns it)");
  }
  for (const v1::JobEvent& event : write->events) {
    if (!event.job_id().empty()) {
      return absl::InvalidArgumentError("store: a new job's events cannot name a job_id");
    }
  }
  for (const v1::Checkpoint& checkpoint : write->checkpoints) {
    if (!checkpoint.job_id().empty()) {
      return absl::InvalidArgumentError("store: a new job's checkpoints cannot name a job_id");
    }
  }
  std::vector<v1::JobEvent> stored_events;
  QueuedWrite queued;
  queued.apply = [this, write, &stored_events]() ABSL_NO_THREAD_SAFETY_ANALYSIS -> absl::Status {
    ASSIGN_OR_RETURN(write->job_id, AllocateJobIdLocked());
    write->job->set_job_id(write->job_id);
    return ApplyWrite(*write, stored_events);
  };
  GroupCommit({&queued});
  if (!queued.status.ok()) {
    write->job_id.clear();
    write->job->clear_job_id();
  }
  return queued.status;
}

void Store::SetWriteObserver(std::function<void(const StoreWriteStats&)> observer) {
  absl::MutexLock lock(&hooks_mu_);
  write_observer_ = std::move(observer);
}

void Store::SetWriteFailureInjector(std::function<absl::Status(const std::string&)> injector) {
  absl::MutexLock lock(&hooks_mu_);
  write_failure_injector_ = std::move(injector);
}

absl::Status Store::InjectedFailure(const std::string& id) {
  std::function<absl::Status(const std::string&)> injector;
  {
    absl::MutexLock lock(&hooks_mu_);
    injector = write_failure_injector_;
  }
  return injector ? injector(id) : absl::OkStatus();
}

void Store::ReportWrite(const StoreWriteStats& stats) {
  std::function<void(const StoreWriteStats&)> observer;
  {
    absl::MutexLock lock(&hooks_mu_);
    observer = write_observer_;
  }
  if (observer) observer(stats);
}

}  // namespace tessera::coordinator
