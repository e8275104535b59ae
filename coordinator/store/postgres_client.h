// What every PostgreSQL connection of the coordinator shares (the store's, postgres_database.h,
// and the leader election's, leader_election.h): libpq's messages as ours, one mapping of a
// failure's SQLSTATE to a status, and one way to find and repair a connection that broke while
// idle. Keeping these in one place keeps both callers classifying the same failure alike (a lock
// or statement timeout, a server shutting down, refused credentials): the election's own copy had
// drifted from the store's (it called every unlisted failure INTERNAL, refused credentials and
// too many connections included, while the store took a statement timeout for INTERNAL).
//
// Thread safety: the functions keep no state; a PGconn is used by one thread at a time.
#pragma once

#include <libpq-fe.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tessera::coordinator {

// libpq's `message` without its trailing newline ("" for null).
std::string PgMessage(const char* message);

// A failure as a status, by SQLSTATE (PostgreSQL's appendix A): unique violation
// ALREADY_EXISTS; connection failures (class 08), a statement cancelled, by its timeout or an
// operator, and a server shutting down (class 57), serialization failures, deadlocks, lock
// timeouts and too many connections UNAVAILABLE (worth retrying); other insufficient resources
// (class 53, e.g. disk full) RESOURCE_EXHAUSTED; refused credentials (class 28) PERMISSION_DENIED;
// data or index corruption DATA_LOSS; a missing database, table or column FAILED_PRECONDITION;
// INTERNAL otherwise. No SQLSTATE (the connection is gone) is UNAVAILABLE.
absl::Status StatusFromSqlState(absl::string_view state, std::string message);

// The status of a statement that did not succeed: `prefix`: libpq's message (the result's, else
// the connection's), classified by the result's SQLSTATE. A result without one on a healthy
// connection (a protocol-level failure) is INTERNAL.
absl::Status PgFailure(PGconn* conn, const PGresult* result, absl::string_view prefix);

// An idle connection whose server went away (a restart, a failover) still says CONNECTION_OK
// until it reads: outside a transaction, this reads what is waiting without blocking (twice: the
// first read may take only the server's farewell notice); a connection found broken is reset.
// Returns whether it reset the connection (statements prepared on it are gone); PQstatus(conn)
// tells whether that worked.
bool PgReconnectIfBroken(PGconn* conn);

}  // namespace tessera::coordinator
