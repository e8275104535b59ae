// SqliteDatabase (sqlite_database.h): opening and checking the connections, the readers' pool
// and the group commit. Thread safety as the header says.
#include "coordinator/sqlite_database.h"

#include <time.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera::coordinator {
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

}  // namespace

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

SqliteConnection::~SqliteConnection() {
  for (auto& [sql, stmt] : statements_) sqlite3_finalize(stmt);
  sqlite3_close(db_);  // a no-op for a null handle
}

absl::StatusOr<sqlite3_stmt*> SqliteConnection::Prepare(absl::string_view sql,
                                                        absl::string_view operation) {
  if (auto it = statements_.find(sql); it != statements_.end()) return it->second;
  sqlite3_stmt* stmt = nullptr;
  const int rc = sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()),
                                    SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(db_, rc, operation);
  statements_.emplace(std::string(sql), stmt);
  return stmt;
}

absl::Status SqliteConnection::Exec(const char* sql, absl::string_view operation) {
  const int rc = sqlite3_exec(db_, sql, nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(db_, rc, operation);
  return absl::OkStatus();
}

absl::Status SqliteConnection::Run(absl::string_view sql, absl::string_view operation) {
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, Prepare(sql, operation));
  SqliteStatement statement(db_, stmt, operation);
  return statement.Run();
}

absl::Status SqliteConnection::FinishTransaction(absl::Status status, absl::string_view operation) {
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

SqliteDatabase::ReadLock::ReadLock(SqliteDatabase& database) ABSL_NO_THREAD_SAFETY_ANALYSIS
    : database_(database) {
  if (database.readers_.empty()) {
    database.mu_.Lock();
    connection_ = &database.writer_;
    is_writer_ = true;
    return;
  }
  absl::MutexLock lock(&database.read_mu_);
  database.read_mu_.Await(absl::Condition(
      +[](std::vector<SqliteConnection*>* idle) { return !idle->empty(); },
      &database.idle_readers_));
  connection_ = database.idle_readers_.back();
  database.idle_readers_.pop_back();
}

SqliteDatabase::ReadLock::~ReadLock() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (is_writer_) {
    database_.mu_.Unlock();
    return;
  }
  absl::MutexLock lock(&database_.read_mu_);
  database_.idle_readers_.push_back(connection_);
}

absl::StatusOr<std::unique_ptr<SqliteDatabase>> SqliteDatabase::Open(const std::string& path,
                                                                     const Options& options) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    absl::Status status = SqliteStatus(db, rc, absl::StrCat("open '", path, "'"));
    sqlite3_close(db);
    return status;
  }
  std::unique_ptr<SqliteDatabase> database(new SqliteDatabase(db, path));
  {
    absl::MutexLock lock(&database->mu_);
    RETURN_IF_ERROR(database->Configure(options));
  }
  if (path != ":memory:") {
    for (int i = 0; i < ReaderCount(); ++i) {
      sqlite3* reader = nullptr;
      const int read_rc = sqlite3_open_v2(path.c_str(), &reader,
                                          SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX, nullptr);
      // Closed by ~SqliteDatabase (with the others) from here on, whatever follows.
      database->readers_.push_back(std::make_unique<SqliteConnection>(reader));
      if (read_rc != SQLITE_OK) {
        return SqliteStatus(reader, read_rc, absl::StrCat("open '", path, "' for reading"));
      }
      sqlite3_extended_result_codes(reader, 1);
      if (const int busy_rc = sqlite3_busy_timeout(reader, options.busy_timeout_ms);
          busy_rc != SQLITE_OK) {
        return SqliteStatus(reader, busy_rc, absl::StrCat("open '", path, "' for reading"));
      }
    }
    absl::MutexLock lock(&database->read_mu_);
    for (auto& reader : database->readers_) database->idle_readers_.push_back(reader.get());
  }
  return database;
}

SqliteDatabase::SqliteDatabase(sqlite3* writer, std::string path)
    : path_(std::move(path)), writer_(writer) {}

SqliteDatabase::~SqliteDatabase() {
  // The readers close first, then the writer (a member, after this body).
  readers_.clear();
}

absl::Status SqliteDatabase::Configure(const Options& options) {
  const std::string operation = absl::StrCat("open '", path_, "'");
  sqlite3* const db = writer_.db();
  sqlite3_extended_result_codes(db, 1);
  if (const int rc = sqlite3_busy_timeout(db, options.busy_timeout_ms); rc != SQLITE_OK) {
    return SqliteStatus(db, rc, operation);
  }
  // The first statement reads the file: a file that is not a database fails
  // here with SQLITE_NOTADB.
  std::string mode;
  {
    // Reset before the migration: a table cannot be dropped while a statement is open.
    ASSIGN_OR_RETURN(sqlite3_stmt * journal_mode_stmt,
                     writer_.Prepare("PRAGMA journal_mode = WAL", operation));
    SqliteStatement journal_mode(db, journal_mode_stmt, operation);
    ASSIGN_OR_RETURN(bool has_row, journal_mode.Step());
    if (has_row) mode = journal_mode.ColumnText(0);
  }
  if (mode != "wal" && !(mode == "memory" && path_ == ":memory:")) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: ", operation, ": journal_mode is '", mode, "', want 'wal'"));
  }
  RETURN_IF_ERROR(writer_.Exec("PRAGMA synchronous = FULL", operation));
  // Pragmas ignore what they do not understand; read the settings back, since
  // durability and referential integrity rest on them.
  constexpr int64_t kSynchronousFull = 2;
  RETURN_IF_ERROR(ExpectPragma("PRAGMA synchronous", kSynchronousFull, operation));
  // Foreign keys go on after the migrations, which rebuild tables with them off.
  RETURN_IF_ERROR(writer_.Exec("PRAGMA foreign_keys = OFF", operation));
  if (options.migrate) RETURN_IF_ERROR(options.migrate(writer_));
  RETURN_IF_ERROR(writer_.Exec("PRAGMA foreign_keys = ON", operation));
  return ExpectPragma("PRAGMA foreign_keys", 1, operation);
}

absl::Status SqliteDatabase::ExpectPragma(const char* pragma, int64_t want,
                                          absl::string_view operation) {
  ASSIGN_OR_RETURN(sqlite3_stmt * stmt, writer_.Prepare(pragma, operation));
  SqliteStatement read(writer_.db(), stmt, operation);
  ASSIGN_OR_RETURN(bool has_row, read.Step());
  const int64_t got = has_row ? read.ColumnInt64(0) : -1;
  if (got != want) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: ", operation, ": ", pragma, " is ", got, ", want ", want));
  }
  return absl::OkStatus();
}

void SqliteDatabase::GroupCommit(const std::vector<QueuedWrite*>& writes) {
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
    SqliteDatabase* database;
    QueuedWrite* first;
    QueuedWrite* last;
    static bool Ready(Turn* turn) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return turn->last->done ||
             (!turn->database->committing_ && !turn->database->queued_.empty() &&
              turn->database->queued_.front() == turn->first);
    }
  } turn{this, first, last};
  while (true) {
    queue_mu_.Await(absl::Condition(&Turn::Ready, &turn));
    if (last->done) break;
    committing_ = true;
    std::vector<QueuedWrite*> batch = std::move(queued_);
    queued_.clear();
    queue_mu_.Unlock();
    const SqliteCommitStats stats = RunBatch(batch);
    const bool any_applied = std::any_of(batch.begin(), batch.end(),
                                         [](const QueuedWrite* w) { return w->status.ok(); });
    if (any_applied) ReportCommit(stats);
    queue_mu_.Lock();
    for (QueuedWrite* write : batch) write->done = true;
    committing_ = false;
  }
}

SqliteCommitStats SqliteDatabase::RunBatch(const std::vector<QueuedWrite*>& batch) {
  absl::MutexLock lock(&mu_);
  sqlite3* const db = writer_.db();
  const absl::Time start = absl::Now();
  const double cpu_start = ThreadCpuSeconds();
  const std::string operation = absl::StrCat("group commit of ", batch.size(), " writes");
  auto finished = [&] {
    return SqliteCommitStats{.seconds = absl::ToDoubleSeconds(absl::Now() - start),
                             .cpu_seconds = ThreadCpuSeconds() - cpu_start,
                             .writes = static_cast<int>(batch.size())};
  };
  absl::Status begun = writer_.Run("BEGIN IMMEDIATE", operation);
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
    failed = write->apply(writer_);
    if (!failed.ok()) break;
  }
  if (failed.ok()) {
    const absl::Status committed = writer_.FinishTransaction(absl::OkStatus(), operation);
    for (QueuedWrite* write : batch) write->status = committed;
    return committed.ok() ? finished() : SqliteCommitStats{};
  }
  if (sqlite3_get_autocommit(db) == 0) {
    sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  if (batch.size() == 1) {
    batch.front()->status = std::move(failed);
    return {};
  }
  begun = writer_.Run("BEGIN IMMEDIATE", operation);
  if (!begun.ok()) {
    for (QueuedWrite* write : batch) write->status = begun;
    return {};
  }
  for (QueuedWrite* write : batch) {
    absl::Status status = writer_.Run("SAVEPOINT write", operation);
    if (status.ok()) status = write->apply(writer_);
    if (status.ok()) {
      status = writer_.Run("RELEASE write", operation);
    } else if (sqlite3_get_autocommit(db) == 0) {
      sqlite3_exec(db, "ROLLBACK TO write", nullptr, nullptr, nullptr);
      sqlite3_exec(db, "RELEASE write", nullptr, nullptr, nullptr);
    }
    write->status = std::move(status);
    if (sqlite3_get_autocommit(db) != 0) {
      // SQLite rolled the whole transaction back (SQLITE_FULL, SQLITE_IOERR): nothing of the
      // batch is stored, and the writes after this one were never tried.
      const absl::Status lost =
          write->status.ok()
              ? absl::InternalError(absl::StrCat("store: ", operation, ": transaction rolled back"))
              : write->status;
      for (QueuedWrite* other : batch) other->status = lost;
      return {};
    }
  }
  absl::Status committed = writer_.FinishTransaction(absl::OkStatus(), operation);
  if (!committed.ok()) {
    for (QueuedWrite* write : batch) {
      if (write->status.ok()) write->status = committed;
    }
  }
  return finished();
}

void SqliteDatabase::SetCommitObserver(std::function<void(const SqliteCommitStats&)> observer) {
  absl::MutexLock lock(&observer_mu_);
  commit_observer_ = std::move(observer);
}

void SqliteDatabase::ReportCommit(const SqliteCommitStats& stats) {
  std::function<void(const SqliteCommitStats&)> observer;
  {
    absl::MutexLock lock(&observer_mu_);
    observer = commit_observer_;
  }
  if (observer) observer(stats);
}

}  // namespace tessera::coordinator
