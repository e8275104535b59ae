// SqliteDatabase: the SQLite plumbing under the Store (store.h), and nothing of what it
// stores: one writing connection with its statement cache, a small pool of read-only
// connections, the durability settings (WAL, synchronous=FULL, foreign keys) checked on open,
// and the group commit that lets concurrent writers share one transaction and one fsync. The
// schema and every table's SQL belong to the caller: Open runs the caller's migration on the
// writer, and each write is a function applied to the writer's connection.
//
// Group commit: the first caller of GroupCommit to find no transaction in progress becomes the
// leader: it takes every write queued so far, applies them in one transaction (when one fails,
// the transaction is rolled back and the batch applied again with a SAVEPOINT for each write, so
// that a failed write is rolled back alone and only its caller sees the error), commits, and
// wakes the others; writes that arrive meanwhile form the next batch. Every caller returns only
// once its writes are durable (or have failed).
//
// Thread safety: SqliteDatabase may be used from any thread. mu_ serializes use of the writing
// connection; a ReadLock holds one reader (or, for ":memory:", the writer under mu_) for one read;
// queue_mu_ guards the queue of writes waiting for the next group commit (taken before mu_, never
// while holding it). The commit observer is called after the mutexes are released, on the thread
// that led the commit, once per SQLite transaction. A SqliteConnection and a SqliteStatement are
// not thread-safe: they are used only by the holder of a ReadLock or by a write inside
// GroupCommit.
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
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "google/protobuf/message_lite.h"

namespace tessera::coordinator {

// A SQLite failure as a status whose message names the operation and carries SQLite's message
// ("store: insert event for job-0001: database is locked"): UNAVAILABLE for SQLITE_BUSY/LOCKED,
// RESOURCE_EXHAUSTED for SQLITE_FULL, DATA_LOSS for SQLITE_CORRUPT, FAILED_PRECONDITION for a
// file that is not a database or cannot be opened, ALREADY_EXISTS for a unique key violation,
// INTERNAL otherwise.
absl::Status SqliteStatus(sqlite3* db, int rc, absl::string_view operation);

// A prepared statement borrowed from a connection's cache for one use: bind, step, read
// columns; reset and unbound when it goes out of scope.
class SqliteStatement {
 public:
  SqliteStatement(sqlite3* db, sqlite3_stmt* stmt, absl::string_view operation)
      : db_(db), stmt_(stmt), operation_(operation) {}
  ~SqliteStatement() {
    sqlite3_reset(stmt_);
    sqlite3_clear_bindings(stmt_);
  }
  SqliteStatement(const SqliteStatement&) = delete;
  SqliteStatement& operator=(const SqliteStatement&) = delete;

  // Parameters are numbered from 1. A failed bind is reported by Step.
  void Bind(int index, int64_t value) { Check(sqlite3_bind_int64(stmt_, index, value)); }
  void BindDouble(int index, double value) { Check(sqlite3_bind_double(stmt_, index, value)); }
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
  absl::Status Run() { return Step().status(); }

  int64_t ColumnInt64(int column) { return sqlite3_column_int64(stmt_, column); }
  double ColumnDouble(int column) { return sqlite3_column_double(stmt_, column); }
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

// One open SQLite connection and the statements prepared on it (each prepared once, kept until
// the connection closes). Closes the connection when destroyed; a null handle is allowed.
class SqliteConnection {
 public:
  explicit SqliteConnection(sqlite3* db) : db_(db) {}
  ~SqliteConnection();
  SqliteConnection(const SqliteConnection&) = delete;
  SqliteConnection& operator=(const SqliteConnection&) = delete;

  sqlite3* db() const { return db_; }
  // `sql` prepared on this connection, from the cache when it was prepared before.
  absl::StatusOr<sqlite3_stmt*> Prepare(absl::string_view sql, absl::string_view operation);
  // Runs `sql` (one or more statements, not cached) with sqlite3_exec.
  absl::Status Exec(const char* sql, absl::string_view operation);
  // Runs one statement that returns no rows, prepared once (the transaction and savepoint
  // statements of every group commit).
  absl::Status Run(absl::string_view sql, absl::string_view operation);
  // Commits when `status` is OK, else rolls back; returns the first failure.
  absl::Status FinishTransaction(absl::Status status, absl::string_view operation);

 private:
  sqlite3* const db_;
  absl::flat_hash_map<std::string, sqlite3_stmt*> statements_;
};

// One SQLite transaction of the group commit, as the commit observer sees it.
struct SqliteCommitStats {
  double seconds = 0;      // wall time, fsync included
  double cpu_seconds = 0;  // CPU time of the thread that led it (the writes are serial here)
  int writes = 0;          // the writes it applied, each in its savepoint (failed ones included)
};

class SqliteDatabase {
 public:
  struct Options {
    // How long a statement waits for a lock held by another connection.
    int busy_timeout_ms = 5000;
    // Creates or migrates the schema on the writer, inside no transaction and with foreign
    // keys off (a migration may rebuild a table); foreign keys go on once it returns OK.
    std::function<absl::Status(SqliteConnection& writer)> migrate;
  };

  // Opens or creates the database at `path` (":memory:" for tests) in WAL mode with
  // synchronous=FULL, runs options.migrate, turns foreign keys on and reads every setting back,
  // then opens the read-only connections (file databases only). A file that is not a SQLite
  // database: FAILED_PRECONDITION naming the path.
  static absl::StatusOr<std::unique_ptr<SqliteDatabase>> Open(const std::string& path,
                                                              const Options& options);

  ~SqliteDatabase();
  SqliteDatabase(const SqliteDatabase&) = delete;
  SqliteDatabase& operator=(const SqliteDatabase&) = delete;

  // The connection a read uses, held for the read: an idle reader when there are readers (it
  // waits for one when all are busy), else the writer (under mu_).
  class ReadLock {
   public:
    explicit ReadLock(SqliteDatabase& database);
    ~ReadLock();
    ReadLock(const ReadLock&) = delete;
    ReadLock& operator=(const ReadLock&) = delete;

    SqliteConnection& connection() const { return *connection_; }

   private:
    SqliteDatabase& database_;
    SqliteConnection* connection_ = nullptr;
    bool is_writer_ = false;  // the writer, under mu_
  };

  // One write waiting for a group commit: `apply` runs on the writer under mu_ inside the
  // batch's transaction, possibly twice (a batch in which another write failed is applied again);
  // `status` and `done` are set by the leader.
  struct QueuedWrite {
    std::function<absl::Status(SqliteConnection& writer)> apply;
    absl::Status status;
    bool done = false;
  };

  // Queues `writes` (all in the same batch) and returns once they are committed or failed,
  // leading the commit when no other caller is.
  void GroupCommit(const std::vector<QueuedWrite*>& writes) ABSL_LOCKS_EXCLUDED(mu_, queue_mu_);

  // Called for each committed SQLite transaction with its wall time (the fsync included), its
  // CPU time and its writes. Pass nullptr to remove.
  void SetCommitObserver(std::function<void(const SqliteCommitStats&)> observer)
      ABSL_LOCKS_EXCLUDED(observer_mu_);

 private:
  SqliteDatabase(sqlite3* writer, std::string path);

  absl::Status Configure(const Options& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FAILED_PRECONDITION unless `pragma` reads `want`.
  absl::Status ExpectPragma(const char* pragma, int64_t want, absl::string_view operation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One transaction over `batch`; returns its times for the observer.
  SqliteCommitStats RunBatch(const std::vector<QueuedWrite*>& batch) ABSL_LOCKS_EXCLUDED(mu_);
  void ReportCommit(const SqliteCommitStats& stats) ABSL_LOCKS_EXCLUDED(observer_mu_);

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
  // The observer has a mutex of its own: taking mu_ for it would wait for the commit in
  // progress (its fsync included).
  absl::Mutex observer_mu_;
  std::function<void(const SqliteCommitStats&)> commit_observer_ ABSL_GUARDED_BY(observer_mu_);
  absl::Mutex queue_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<QueuedWrite*> queued_ ABSL_GUARDED_BY(queue_mu_);
  bool committing_ ABSL_GUARDED_BY(queue_mu_) = false;
};

}  // namespace tessera::coordinator
