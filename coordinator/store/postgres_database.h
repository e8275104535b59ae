// PostgresDatabase: the PostgreSQL implementation of the store's Database seam
// (store_database.h) over libpq, for a coordinator whose state must outlive its machine. Like
// SqliteDatabase it knows no table: one writing connection on which each group commit is one
// transaction (a batch in which a write fails is rolled back and applied again with a SAVEPOINT
// per write, so that only the failing write's caller sees its error), and a small pool of read
// connections, each read in its own autocommit statement (READ COMMITTED: it sees what was
// committed before it started).
//
// Statements are prepared on the server once per connection, on their first execution, with
// the parameter types of that first binding (bigint, double precision, text, bytea); results
// come back in binary. The common dialect's `?N` parameters become `$N`, and Exec rewrites DDL
// types (store_database.h). A connection that breaks (the server restarted, a network cut) is
// re-established at the start of the next batch or read; the batch or read that met the break
// fails UNAVAILABLE. A COMMIT whose reply was lost is reported UNAVAILABLE as well, though it may
// have been applied.
//
// Durability: every COMMIT waits for the server's WAL flush: Open refuses a server whose
// synchronous_commit is off. Credentials: the password comes from Options::password when set,
// else from libpq's own PGPASSWORD or PGPASSFILE (~/.pgpass); never from a URL in messages, which
// name the URL with its password removed.
//
// Thread safety: as for every Database. mu_ serializes the writer; read_mu_ guards the idle
// readers. A PostgresConnection and its statements are used by one thread at a time (the holder
// of a ReadLock, or the leader of a group commit under mu_).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/store/store_database.h"

namespace tessera::coordinator {

class PostgresConnection;

// `url` with its password (user:password@, or password=...) replaced by "***", for messages.
std::string RedactPostgresUrl(const std::string& url);

// The common dialect's SQL for PostgreSQL: `?N` parameters as `$N` (outside quoted text), and
// `*max_parameter` set to the largest N.
std::string PostgresParameters(absl::string_view sql, int* max_parameter);
// DDL in the common dialect for PostgreSQL: INTEGER as BIGINT, REAL as DOUBLE PRECISION, BLOB as
// BYTEA, WITHOUT ROWID dropped (whole upper-case words, outside quoted text).
std::string PostgresDdl(absl::string_view sql);

class PostgresDatabase final : public Database {
 public:
  struct Options {
    // A libpq connection URI (postgresql://user@host:port/dbname?sslmode=...).
    std::string url;
    // Overrides PGPASSWORD / PGPASSFILE when not empty.
    std::string password;
    // Read connections; reads wait for an idle one.
    int readers = 4;
    // How long connecting to the server may take.
    int connect_timeout_seconds = 10;
    // Creates or migrates the schema on the writer before the readers open.
    std::function<absl::Status(DbConnection& writer)> migrate;
  };

  // Connects the writer, checks its settings, runs options.migrate, then connects the readers.
  // A server that cannot be reached: UNAVAILABLE naming the redacted URL; refused credentials:
  // PERMISSION_DENIED; synchronous_commit off: FAILED_PRECONDITION.
  static absl::StatusOr<std::unique_ptr<PostgresDatabase>> Open(const Options& options);

  ~PostgresDatabase() override;

  SqlDialect dialect() const override { return SqlDialect::kPostgres; }

 protected:
  DatabaseCommitStats RunBatch(const std::vector<QueuedWrite*>& batch) override
      ABSL_LOCKS_EXCLUDED(mu_);
  DbConnection* AcquireReader() override ABSL_LOCKS_EXCLUDED(read_mu_);
  void ReleaseReader(DbConnection* connection) override ABSL_LOCKS_EXCLUDED(read_mu_);

 private:
  explicit PostgresDatabase(std::unique_ptr<PostgresConnection> writer);

  // The batch in one transaction, a savepoint per write (after a failure in the first try).
  absl::Status ApplyWithSavepoints(const std::vector<QueuedWrite*>& batch,
                                   absl::string_view operation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  const std::unique_ptr<PostgresConnection> writer_ ABSL_PT_GUARDED_BY(mu_);
  // Set once by Open.
  std::vector<std::unique_ptr<PostgresConnection>> readers_;
  absl::Mutex read_mu_;
  std::vector<PostgresConnection*> idle_readers_ ABSL_GUARDED_BY(read_mu_);
};

}  // namespace tessera::coordinator
