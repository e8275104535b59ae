// The storage seam under the Store (store.h): what the store's table code needs from a SQL
// database, with two implementations, SQLite (sqlite_database.h, the embedded default) and
// PostgreSQL (postgres_database.h). A DbConnection prepares statements (each prepared once per
// connection and kept), a DbStatement binds typed parameters, steps and reads typed columns,
// and a Database owns the connections: one writer, on which writes are applied in group commits,
// and a pool of readers.
//
// The SQL the table code writes is one dialect both engines accept: parameters numbered `?1`,
// `?2`, ... (the PostgreSQL connection rewrites them to `$1`, `$2`, ...), column types INTEGER,
// REAL, TEXT and BLOB in DDL passed to DbConnection::Exec (rewritten to BIGINT, DOUBLE PRECISION,
// TEXT and BYTEA for PostgreSQL, where INTEGER is 32 bits and REAL 32-bit floating point), column
// references qualified where PostgreSQL would find them ambiguous (`counters.value` in an ON
// CONFLICT DO UPDATE), and integer literals cast where a 64-bit result is needed. What only one
// engine has (PRAGMAs, advisory locks, WITHOUT ROWID) is chosen by dialect().
//
// Group commit: the first caller of GroupCommit to find no transaction in progress becomes the
// leader: it takes every write queued so far, hands them to the implementation's RunBatch (one
// transaction; when a write fails, the batch is applied again with a SAVEPOINT for each write,
// so that a failed write is rolled back alone and only its caller sees the error), and wakes the
// others; writes that arrive meanwhile form the next batch. Every caller returns only once its
// writes are durable (or have failed).
//
// Thread safety: a Database may be used from any thread. queue_mu_ guards the queue of writes
// waiting for the next group commit; the implementation serializes its writer inside RunBatch
// (taken after queue_mu_ is released). A ReadLock holds one connection for one read. The commit
// observer is called outside every mutex, on the thread that led the commit, once per
// transaction. A DbConnection and its statements are not thread-safe: they are used only by the
// holder of a ReadLock or by a write inside GroupCommit.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message_lite.h"

namespace tessera::coordinator {

enum class SqlDialect { kSqlite, kPostgres };

// One prepared statement of a connection's cache. Parameters are numbered from 1; a parameter
// left unbound is NULL. A failed bind is reported by Step.
class DbStatement {
 public:
  virtual ~DbStatement() = default;

  virtual void Bind(int index, int64_t value) = 0;
  virtual void BindDouble(int index, double value) = 0;
  virtual void BindText(int index, absl::string_view value) = 0;
  virtual void BindNull(int index) = 0;
  virtual void BindBlob(int index, absl::string_view bytes) = 0;

  // True when a row is ready, false when done.
  virtual absl::StatusOr<bool> Step() = 0;
  // Rows inserted, updated or deleted by the statement last stepped to its end.
  virtual int64_t Changes() = 0;

  virtual int64_t ColumnInt64(int column) = 0;
  virtual double ColumnDouble(int column) = 0;
  virtual bool ColumnIsNull(int column) = 0;
  // The column's bytes, valid until the next Step.
  virtual absl::string_view ColumnBytes(int column) = 0;
  std::string ColumnText(int column) { return std::string(ColumnBytes(column)); }

  // Back to unbound and unstepped, for the next borrower.
  virtual void Reset() = 0;

  // What error messages name ("store: <operation>: <engine's message>"); set by Prepare.
  void set_operation(absl::string_view operation) { operation_ = operation; }
  absl::string_view operation() const { return operation_; }

 private:
  absl::string_view operation_;
};

// A DbStatement borrowed from its connection's cache for one use: reset and unbound when it goes
// out of scope. The methods are DbStatement's.
class Statement {
 public:
  explicit Statement(DbStatement* statement) : statement_(statement) {}
  Statement(Statement&& other) noexcept : statement_(other.statement_) {
    other.statement_ = nullptr;
  }
  Statement& operator=(Statement&&) = delete;
  Statement(const Statement&) = delete;
  ~Statement() {
    if (statement_ != nullptr) statement_->Reset();
  }

  void Bind(int index, int64_t value) { statement_->Bind(index, value); }
  void BindDouble(int index, double value) { statement_->BindDouble(index, value); }
  void BindText(int index, absl::string_view value) { statement_->BindText(index, value); }
  // Empty text binds NULL.
  void BindTextOrNull(int index, absl::string_view value) {
    if (value.empty()) {
      statement_->BindNull(index);
    } else {
      statement_->BindText(index, value);
    }
  }
  void BindBlob(int index, absl::string_view bytes) { statement_->BindBlob(index, bytes); }
  void BindMessage(int index, const google::protobuf::MessageLite& message) {
    statement_->BindBlob(index, message.SerializeAsString());
  }
  absl::StatusOr<bool> Step() { return statement_->Step(); }
  // Steps a statement that returns no rows.
  absl::Status Run() { return statement_->Step().status(); }
  int64_t Changes() { return statement_->Changes(); }
  int64_t ColumnInt64(int column) { return statement_->ColumnInt64(column); }
  double ColumnDouble(int column) { return statement_->ColumnDouble(column); }
  bool ColumnIsNull(int column) { return statement_->ColumnIsNull(column); }
  absl::string_view ColumnBytes(int column) { return statement_->ColumnBytes(column); }
  std::string ColumnText(int column) { return statement_->ColumnText(column); }
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
  DbStatement* statement_;
};

// One open connection and the statements prepared on it.
class DbConnection {
 public:
  virtual ~DbConnection() = default;
  virtual SqlDialect dialect() const = 0;
  // `sql` (the common dialect, one statement) prepared on this connection, from the cache when
  // it was prepared before. `operation` must outlive the returned Statement.
  virtual absl::StatusOr<Statement> Prepare(absl::string_view sql, absl::string_view operation) = 0;
  // Runs `sql` (one or more statements, not cached, no parameters; DDL types rewritten as the
  // file comment says).
  virtual absl::Status Exec(absl::string_view sql, absl::string_view operation) = 0;
  // Starts the transaction of a write (SQLite: BEGIN IMMEDIATE, taking the write lock now).
  virtual absl::Status Begin(absl::string_view operation) = 0;
  // Commits when `status` is OK, else rolls back; returns the first failure.
  virtual absl::Status FinishTransaction(absl::Status status, absl::string_view operation) = 0;
};

// One transaction of the group commit, as the commit observer sees it.
struct DatabaseCommitStats {
  double seconds = 0;      // wall time, the durable flush included
  double cpu_seconds = 0;  // CPU time of the thread that led it (the writes are serial here)
  int writes = 0;          // the writes it applied (failed ones included)
};

class Database {
 public:
  virtual ~Database() = default;
  Database(const Database&) = delete;
  Database& operator=(const Database&) = delete;

  virtual SqlDialect dialect() const = 0;

  // The connection a read uses, held for the read (it waits for an idle one when all are busy).
  class ReadLock {
   public:
    explicit ReadLock(Database& database)
        : database_(database), connection_(database.AcquireReader()) {}
    ~ReadLock() { database_.ReleaseReader(connection_); }
    ReadLock(const ReadLock&) = delete;
    ReadLock& operator=(const ReadLock&) = delete;

    DbConnection& connection() const { return *connection_; }

   private:
    Database& database_;
    DbConnection* const connection_;
  };

  // One write waiting for a group commit: `apply` runs on the writer inside the batch's
  // transaction, possibly twice (a batch in which another write failed is applied again);
  // `status` and `done` are set by the leader.
  struct QueuedWrite {
    std::function<absl::Status(DbConnection& writer)> apply;
    absl::Status status;
    bool done = false;
  };

  // Queues `writes` (all in the same batch) and returns once they are committed or failed,
  // leading the commit when no other caller is.
  void GroupCommit(const std::vector<QueuedWrite*>& writes) ABSL_LOCKS_EXCLUDED(queue_mu_);

  // Called for each committed transaction with its wall time, CPU time and writes. Pass nullptr
  // to remove.
  void SetCommitObserver(std::function<void(const DatabaseCommitStats&)> observer)
      ABSL_LOCKS_EXCLUDED(observer_mu_);

  // The leader's fence (coordinator/store/leader_election.h): run on the writer at the start of
  // every write transaction, before any write of the batch; a failure refuses the whole batch
  // (every write gets that status, nothing is stored). With PostgreSQL it locks the lease row, so
  // that a takeover waits for the transaction and the transaction sees a takeover committed before
  // it. SQLite has no election: its RunBatch runs the fence too, but nothing sets one there.
  // Pass nullptr to remove.
  using Fence = std::function<absl::Status(DbConnection& writer)>;
  void SetFence(Fence fence) ABSL_LOCKS_EXCLUDED(fence_mu_);

 protected:
  Database() = default;

  // One transaction over `batch`, setting each write's status; its times for the observer (an
  // empty result when nothing was committed).
  virtual DatabaseCommitStats RunBatch(const std::vector<QueuedWrite*>& batch) = 0;
  // A connection for one read, never null; blocks until one is idle.
  virtual DbConnection* AcquireReader() = 0;
  virtual void ReleaseReader(DbConnection* connection) = 0;
  // Runs the fence (OK when none is set); RunBatch calls it after BEGIN.
  absl::Status CheckFence(DbConnection& writer) ABSL_LOCKS_EXCLUDED(fence_mu_);

 private:
  void ReportCommit(const DatabaseCommitStats& stats) ABSL_LOCKS_EXCLUDED(observer_mu_);

  // The observer has a mutex of its own: a commit in progress never waits for it.
  absl::Mutex observer_mu_;
  std::function<void(const DatabaseCommitStats&)> commit_observer_ ABSL_GUARDED_BY(observer_mu_);
  // Set once before the leader serves; its own mutex, as the observer's.
  absl::Mutex fence_mu_;
  Fence fence_ ABSL_GUARDED_BY(fence_mu_);
  absl::Mutex queue_mu_;
  std::vector<QueuedWrite*> queued_ ABSL_GUARDED_BY(queue_mu_);
  bool committing_ ABSL_GUARDED_BY(queue_mu_) = false;
};

// CPU time of the calling thread, in seconds (0 where the clock cannot be read).
double ThreadCpuSeconds();

}  // namespace tessera::coordinator
