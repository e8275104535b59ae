// SqliteDatabase: the SQLite implementation of the store's Database seam (store_database.h), and
// nothing of what the store keeps: one writing connection with its statement cache, a small pool
// of read-only connections, the durability settings (WAL, synchronous=FULL, foreign keys)
// checked on open, and the transaction of each group commit. The schema and every table's SQL
// belong to the caller: Open runs the caller's migration on the writer, and each write is a
// function applied to the writer's connection.
//
// A batch is applied in one transaction (BEGIN IMMEDIATE); when one write fails, the transaction
// is rolled back and the batch applied again with a SAVEPOINT for each write, so that a failed
// write is rolled back alone and only its caller sees the error.
//
// Thread safety: SqliteDatabase may be used from any thread. mu_ serializes use of the writing
// connection; a ReadLock holds one reader (or, for ":memory:", the writer under mu_) for one
// read. A SqliteConnection and its statements are not thread-safe: they are used only by the
// holder of a ReadLock or by a write inside GroupCommit.
#pragma once

#include <sqlite3.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/store/store_database.h"

namespace tessera::coordinator {

// A SQLite failure as a status whose message names the operation and carries SQLite's message
// ("store: insert event for job-0001: database is locked"): UNAVAILABLE for SQLITE_BUSY/LOCKED,
// RESOURCE_EXHAUSTED for SQLITE_FULL, DATA_LOSS for SQLITE_CORRUPT, FAILED_PRECONDITION for a
// file that is not a database or cannot be opened, ALREADY_EXISTS for a unique key violation,
// INTERNAL otherwise.
absl::Status SqliteStatus(sqlite3* db, int rc, absl::string_view operation);

// A statement prepared on a SqliteConnection, kept until the connection closes.
class SqliteStatement final : public DbStatement {
 public:
  SqliteStatement(sqlite3* db, sqlite3_stmt* stmt) : db_(db), stmt_(stmt) {}
  ~SqliteStatement() override { sqlite3_finalize(stmt_); }

  void Bind(int index, int64_t value) override { Check(sqlite3_bind_int64(stmt_, index, value)); }
  void BindDouble(int index, double value) override {
    Check(sqlite3_bind_double(stmt_, index, value));
  }
  void BindText(int index, absl::string_view value) override {
    Check(sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()),
                            SQLITE_TRANSIENT));
  }
  void BindNull(int index) override { Check(sqlite3_bind_null(stmt_, index)); }
  void BindBlob(int index, absl::string_view bytes) override {
    Check(sqlite3_bind_blob(stmt_, index, bytes.data(), static_cast<int>(bytes.size()),
                            SQLITE_TRANSIENT));
  }
  absl::StatusOr<bool> Step() override;
  int64_t Changes() override { return sqlite3_changes(db_); }
  int64_t ColumnInt64(int column) override { return sqlite3_column_int64(stmt_, column); }
  double ColumnDouble(int column) override { return sqlite3_column_double(stmt_, column); }
  bool ColumnIsNull(int column) override {
    return sqlite3_column_type(stmt_, column) == SQLITE_NULL;
  }
  absl::string_view ColumnBytes(int column) override {
    const void* data = sqlite3_column_blob(stmt_, column);
    return {static_cast<const char*>(data),
            static_cast<size_t>(sqlite3_column_bytes(stmt_, column))};
  }
  void Reset() override {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
    bind_rc_ = SQLITE_OK;
  }

 private:
  void Check(int rc) {
    if (rc != SQLITE_OK && bind_rc_ == SQLITE_OK) bind_rc_ = rc;
  }

  sqlite3* const db_;
  sqlite3_stmt* const stmt_;
  int bind_rc_ = SQLITE_OK;
};

// One open SQLite connection and the statements prepared on it. Closes the connection when
// destroyed; a null handle is allowed.
class SqliteConnection final : public DbConnection {
 public:
  explicit SqliteConnection(sqlite3* db) : db_(db) {}
  ~SqliteConnection() override;
  SqliteConnection(const SqliteConnection&) = delete;
  SqliteConnection& operator=(const SqliteConnection&) = delete;

  sqlite3* db() const { return db_; }
  SqlDialect dialect() const override { return SqlDialect::kSqlite; }
  absl::StatusOr<Statement> Prepare(absl::string_view sql, absl::string_view operation) override;
  // Runs `sql` (one or more statements, not cached) with sqlite3_exec.
  absl::Status Exec(absl::string_view sql, absl::string_view operation) override;
  absl::Status Begin(absl::string_view operation) override;
  absl::Status FinishTransaction(absl::Status status, absl::string_view operation) override;
  // Runs one statement that returns no rows, prepared once (the transaction and savepoint
  // statements of every group commit).
  absl::Status Run(absl::string_view sql, absl::string_view operation);

 private:
  sqlite3* const db_;
  // Destroyed (finalized) before the connection closes, in ~SqliteConnection.
  absl::flat_hash_map<std::string, std::unique_ptr<SqliteStatement>> statements_;
};

class SqliteDatabase final : public Database {
 public:
  struct Options {
    // How long a statement waits for a lock held by another connection.
    int busy_timeout_ms = 5000;
    // Creates or migrates the schema on the writer, inside no transaction and with foreign
    // keys off (a migration may rebuild a table); foreign keys go on once it returns OK.
    std::function<absl::Status(DbConnection& writer)> migrate;
  };

  // Opens or creates the database at `path` (":memory:" for tests) in WAL mode with
  // synchronous=FULL, runs options.migrate, turns foreign keys on and reads every setting back,
  // then opens the read-only connections (file databases only). A file that is not a SQLite
  // database: FAILED_PRECONDITION naming the path.
  static absl::StatusOr<std::unique_ptr<SqliteDatabase>> Open(const std::string& path,
                                                              const Options& options);

  ~SqliteDatabase() override;

  SqlDialect dialect() const override { return SqlDialect::kSqlite; }

 protected:
  DatabaseCommitStats RunBatch(const std::vector<QueuedWrite*>& batch) override
      ABSL_LOCKS_EXCLUDED(mu_);
  DbConnection* AcquireReader() override;
  void ReleaseReader(DbConnection* connection) override;

 private:
  SqliteDatabase(sqlite3* writer, std::string path);

  absl::Status Configure(const Options& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless `pragma` reads `want`.
  absl::Status ExpectPragma(const char* pragma, int64_t want, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  SqliteConnection writer_ ABSL_GUARDED_BY(mu_);
  // Reads go through read-only connections (file databases only), so that they never wait for a
  // group commit and its fsync on the writer: in WAL mode each reads the last committed state
  // while a transaction is open on the writer. There are several, so that readers on different
  // threads do not queue behind one another. Empty for ":memory:" (reads then use the writer).
  // Set once by Open.
  std::vector<std::unique_ptr<SqliteConnection>> readers_;
  absl::Mutex read_mu_;
  std::vector<SqliteConnection*> idle_readers_ ABSL_GUARDED_BY(read_mu_);
};

}  // namespace tessera::coordinator
