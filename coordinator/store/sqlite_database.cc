// SqliteDatabase (sqlite_database.h): opening and checking the connections, the readers' pool
// and the transaction of each group commit. Thread safety as the header says.
#include "coordinator/store/sqlite_database.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace tessera::coordinator {
namespace {

// How many read-only connections a file database gets: one per core, at most 4. SQLite's WAL
// index has 5 read marks (one for a fully checkpointed database, 4 for snapshots); with at most
// 4 readers every open read transaction can hold a mark of its own, so none waits for one.
int ReaderCount() {
  return static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
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

absl::StatusOr<bool> SqliteStatement::Step() {
  if (bind_rc_ != SQLITE_OK) return SqliteStatus(db_, bind_rc_, operation());
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return SqliteStatus(db_, rc, operation());
}

SqliteConnection::~SqliteConnection() {
  statements_.clear();  // finalized before the connection closes
  sqlite3_close(db_);   // a no-op for a null handle
}

absl::StatusOr<Statement> SqliteConnection::Prepare(absl::string_view sql,
                                                    absl::string_view operation) {
  auto it = statements_.find(sql);
  if (it == statements_.end()) {
    sqlite3_stmt* stmt = nullptr;
    const int rc = sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()),
                                      SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
    if (rc != SQLITE_OK) return SqliteStatus(db_, rc, operation);
    it = statements_.emplace(std::string(sql), std::make_unique<SqliteStatement>(db_, stmt)).first;
  }
  it->second->set_operation(operation);
  return Statement(it->second.get());
}

absl::Status SqliteConnection::Exec(absl::string_view sql, absl::string_view operation) {
  const int rc = sqlite3_exec(db_, std::string(sql).c_str(), nullptr, nullptr, nullptr);
  if (rc != SQLITE_OK) return SqliteStatus(db_, rc, operation);
  return absl::OkStatus();
}

absl::Status SqliteConnection::Begin(absl::string_view operation) {
  return Run("BEGIN IMMEDIATE", operation);
}

absl::Status SqliteConnection::Run(absl::string_view sql, absl::string_view operation) {
  ASSIGN_OR_RETURN(Statement statement, Prepare(sql, operation));
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

DbConnection* SqliteDatabase::AcquireReader() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (readers_.empty()) {
    mu_.Lock();  // released by ReleaseReader
    return &writer_;
  }
  absl::MutexLock lock(&read_mu_);
  read_mu_.Await(absl::Condition(
      +[](std::vector<SqliteConnection*>* idle) { return !idle->empty(); }, &idle_readers_));
  SqliteConnection* reader = idle_readers_.back();
  idle_readers_.pop_back();
  return reader;
}

void SqliteDatabase::ReleaseReader(DbConnection* connection) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (connection == &writer_) {
    mu_.Unlock();
    return;
  }
  absl::MutexLock lock(&read_mu_);
  idle_readers_.push_back(static_cast<SqliteConnection*>(connection));
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
    ASSIGN_OR_RETURN(Statement journal_mode,
                     writer_.Prepare("PRAGMA journal_mode = WAL", operation));
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
  ASSIGN_OR_RETURN(Statement read, writer_.Prepare(pragma, operation));
  ASSIGN_OR_RETURN(bool has_row, read.Step());
  const int64_t got = has_row ? read.ColumnInt64(0) : -1;
  if (got != want) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: ", operation, ": ", pragma, " is ", got, ", want ", want));
  }
  return absl::OkStatus();
}

DatabaseCommitStats SqliteDatabase::RunBatch(const std::vector<QueuedWrite*>& batch) {
  absl::MutexLock lock(&mu_);
  sqlite3* const db = writer_.db();
  const absl::Time start = absl::Now();
  const double cpu_start = ThreadCpuSeconds();
  const std::string operation = absl::StrCat("group commit of ", batch.size(), " writes");
  auto finished = [&] {
    return DatabaseCommitStats{.seconds = absl::ToDoubleSeconds(absl::Now() - start),
                               .cpu_seconds = ThreadCpuSeconds() - cpu_start,
                               .writes = static_cast<int>(batch.size())};
  };
  absl::Status begun = writer_.Run("BEGIN IMMEDIATE", operation);
  if (begun.ok()) begun = CheckFence(writer_);  // none is set on SQLite (store_database.h)
  if (!begun.ok()) {
    if (sqlite3_get_autocommit(db) == 0) sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr);
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
    return committed.ok() ? finished() : DatabaseCommitStats{};
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

}  // namespace tessera::coordinator
