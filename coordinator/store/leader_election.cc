// LeaderElection (leader_election.h): the lease row's SQL on a libpq connection of its own, the
// renewal thread and the fence. Thread safety as the header says.
#include "coordinator/store/leader_election.h"

#include <libpq-fe.h>
#include <unistd.h>

#include <cctype>
#include <iostream>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/store/postgres_client.h"
#include "coordinator/store/postgres_database.h"

namespace tessera::coordinator {
namespace {

// The advisory lock serializes the table's creation between coordinators starting at once
// (CREATE TABLE IF NOT EXISTS is not safe against a concurrent one in PostgreSQL); its key is any
// constant of our own.
constexpr char kCreateTable[] =
    "BEGIN;"
    "SELECT pg_advisory_xact_lock(7465737365726131);"
    "CREATE TABLE IF NOT EXISTS tessera_leader_lease ("
    "  id INTEGER PRIMARY KEY CHECK (id = 1),"
    "  epoch BIGINT NOT NULL,"
    "  holder TEXT NOT NULL,"
    "  address TEXT NOT NULL,"
    "  renewed_at TIMESTAMPTZ,"
    "  expires_at TIMESTAMPTZ NOT NULL);"
    "INSERT INTO tessera_leader_lease VALUES (1, 0, '', '', NULL, '-infinity')"
    "  ON CONFLICT (id) DO NOTHING;"
    "COMMIT;";

// Takes an expired lease with the next epoch, or refreshes our own. The row is locked FOR UPDATE
// first: that waits for every write transaction in flight (each holds the row FOR KEY SHARE, see
// kFence), so a write fenced under the old epoch commits before the new epoch exists.
constexpr char kAcquire[] =
    "WITH locked AS (SELECT id FROM tessera_leader_lease WHERE id = 1 FOR UPDATE)"
    " UPDATE tessera_leader_lease SET"
    "  epoch = CASE WHEN holder = $1 AND epoch = $4::bigint THEN epoch ELSE epoch + 1 END,"
    "  holder = $1, address = $2, renewed_at = now(),"
    "  expires_at = now() + make_interval(secs => $3::double precision)"
    " WHERE id = (SELECT id FROM locked)"
    "  AND (expires_at <= now() OR (holder = $1 AND epoch = $4::bigint))"
    " RETURNING epoch";

// Renewal and release change no key column, so their row lock (FOR NO KEY UPDATE) does not wait
// for the leader's own write transactions: a slow group commit cannot starve the renewal.
constexpr char kRenew[] =
    "UPDATE tessera_leader_lease SET renewed_at = now(),"
    "  expires_at = now() + make_interval(secs => $3::double precision)"
    " WHERE id = 1 AND holder = $1 AND epoch = $2::bigint RETURNING epoch";

constexpr char kRelease[] =
    "UPDATE tessera_leader_lease SET expires_at = '-infinity'"
    " WHERE id = 1 AND holder = $1 AND epoch = $2::bigint";

constexpr char kCurrent[] =
    "SELECT epoch, holder, address, expires_at > now() FROM tessera_leader_lease WHERE id = 1";

// In the writer's transaction: a takeover's FOR UPDATE waits for this lock, and this waits for a
// takeover in progress (and then reads the row it committed). FOR KEY SHARE, not FOR SHARE: the
// leader's renewal (an UPDATE of no key column) must not queue behind its own writes, or a
// commit slower than half the lease makes the leader lose its lease to itself.
constexpr char kFence[] =
    "SELECT epoch, address FROM tessera_leader_lease WHERE id = 1 FOR KEY SHARE";

std::string DefaultHolder() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::random_device random;
  return absl::StrCat(host, ":", getpid(), ":", absl::Hex(random(), absl::kZeroPad8));
}

std::string Seconds(absl::Duration duration) {
  return absl::StrCat(absl::ToDoubleSeconds(duration));
}

}  // namespace

LeaderElection::LeaderElection(const LeaderElectionOptions& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<LeaderElection>> LeaderElection::Connect(
    const LeaderElectionOptions& options) {
  if (options.lease <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--leader_lease_seconds: must be more than 0");
  }
  LeaderElectionOptions resolved = options;
  if (resolved.holder.empty()) resolved.holder = DefaultHolder();
  if (resolved.renew_interval <= absl::ZeroDuration()) resolved.renew_interval = options.lease / 5;
  std::unique_ptr<LeaderElection> election(new LeaderElection(resolved));
  const std::string redacted = RedactPostgresUrl(options.url);
  const std::string timeout = absl::StrCat(options.connect_timeout_seconds);
  // A takeover must not block behind a paused leader's transaction for ever, nor a renewal
  // hang on a cut network: both time out below the lease and are tried again.
  const int64_t lease_ms = absl::ToInt64Milliseconds(options.lease);
  const std::string server_options = absl::StrCat(
      "-c client_min_messages=warning -c lock_timeout=", std::max<int64_t>(lease_ms / 2, 1),
      " -c statement_timeout=", std::max<int64_t>(lease_ms, 1));
  std::vector<const char*> keys = {"dbname", "connect_timeout", "application_name", "options"};
  std::vector<const char*> values = {options.url.c_str(), timeout.c_str(),
                                     "tessera-coordinator-election", server_options.c_str()};
  if (!options.password.empty()) {
    keys.push_back("password");
    values.push_back(options.password.c_str());
  }
  keys.push_back(nullptr);
  values.push_back(nullptr);
  absl::MutexLock lock(&election->conn_mu_);
  election->conn_ = PQconnectdbParams(keys.data(), values.data(), /*expand_dbname=*/1);
  if (election->conn_ == nullptr || PQstatus(election->conn_) != CONNECTION_OK) {
    return absl::UnavailableError(absl::StrCat("leader election: connect to ", redacted, ": ",
                                               PgMessage(PQerrorMessage(election->conn_))));
  }
  PGresult* created = PQexec(election->conn_, kCreateTable);
  const bool ok = PQresultStatus(created) == PGRES_COMMAND_OK;
  const std::string error = PgMessage(PQresultErrorMessage(created));
  PQclear(created);
  if (!ok) {
    return absl::UnavailableError(
        absl::StrCat("leader election: create tessera_leader_lease in ", redacted, ": ", error));
  }
  return election;
}

void LeaderElection::StopRenewing() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (renewer_.joinable()) renewer_.join();
}

absl::Status LeaderElection::Release() {
  StopRenewing();
  int64_t ours = 0;
  {
    absl::MutexLock lock(&mu_);
    ours = epoch_;
    // Whatever comes now (a write after all) is refused and reported by no one.
    lost_ = true;
    on_lost_ = nullptr;
  }
  if (ours == 0) return absl::OkStatus();
  absl::MutexLock lock(&conn_mu_);
  return Query(kRelease, {options_.holder, absl::StrCat(ours)}).status();
}

LeaderElection::~LeaderElection() {
  StopRenewing();
  absl::MutexLock lock(&conn_mu_);
  if (conn_ != nullptr) PQfinish(conn_);
}

absl::StatusOr<std::vector<std::vector<std::string>>> LeaderElection::Query(
    const std::string& sql, const std::vector<std::string>& parameters) {
  // As the store's connections: find a server's restart before the query.
  PgReconnectIfBroken(conn_);
  if (PQstatus(conn_) != CONNECTION_OK) {
    return absl::UnavailableError(absl::StrCat("leader election: reconnect to ",
                                               RedactPostgresUrl(options_.url), ": ",
                                               PgMessage(PQerrorMessage(conn_))));
  }
  std::vector<const char*> values;
  for (const std::string& parameter : parameters) values.push_back(parameter.c_str());
  PGresult* result = PQexecParams(conn_, sql.c_str(), static_cast<int>(values.size()), nullptr,
                                  values.data(), nullptr, nullptr, /*resultFormat=*/0);
  const ExecStatusType status = PQresultStatus(result);
  if (status != PGRES_TUPLES_OK && status != PGRES_COMMAND_OK) {
    // Classified as the store's failures are (a broken connection, a shutdown, a lock timeout:
    // UNAVAILABLE, worth trying again).
    absl::Status failure = PgFailure(conn_, result, "leader election");
    PQclear(result);
    return failure;
  }
  std::vector<std::vector<std::string>> rows(PQntuples(result));
  for (int row = 0; row < PQntuples(result); ++row) {
    for (int column = 0; column < PQnfields(result); ++column) {
      rows[row].emplace_back(PQgetvalue(result, row, column));
    }
  }
  PQclear(result);
  return rows;
}

absl::StatusOr<bool> LeaderElection::TryAcquire() {
  const int64_t ours = epoch();
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<std::vector<std::string>>> rows;
  {
    absl::MutexLock lock(&conn_mu_);
    rows = Query(kAcquire, {options_.holder, options_.advertise_address, Seconds(options_.lease),
                            absl::StrCat(ours)});
  }
  if (!rows.ok()) return rows.status();
  if (rows->empty()) return false;
  int64_t epoch = 0;
  if (!absl::SimpleAtoi((*rows)[0][0], &epoch)) {
    return absl::InternalError(absl::StrCat("leader election: epoch '", (*rows)[0][0], "'"));
  }
  absl::MutexLock lock(&mu_);
  epoch_ = epoch;
  renewed_ = started;
  return true;
}

absl::Status LeaderElection::Renew() {
  const int64_t ours = epoch();
  const auto started = std::chrono::steady_clock::now();
  absl::StatusOr<LeaderInfo> now;
  {
    absl::MutexLock lock(&conn_mu_);
    absl::StatusOr<std::vector<std::vector<std::string>>> rows =
        Query(kRenew, {options_.holder, absl::StrCat(ours), Seconds(options_.lease)});
    if (!rows.ok()) return rows.status();
    if (!rows->empty() && ours != 0) {
      absl::MutexLock state(&mu_);
      renewed_ = started;
      return absl::OkStatus();
    }
    now = CurrentLocked();
  }
  if (!now.ok()) return now.status();
  return absl::FailedPreconditionError(
      absl::StrCat("leadership epoch ", ours, " was superseded by ", now->epoch, " at ",
                   now->address.empty() ? "(none)" : now->address));
}

absl::StatusOr<LeaderInfo> LeaderElection::Current() {
  absl::MutexLock lock(&conn_mu_);
  return CurrentLocked();
}

absl::StatusOr<LeaderInfo> LeaderElection::CurrentLocked() {
  ASSIGN_OR_RETURN(auto rows, Query(kCurrent, {}));
  if (rows.empty()) return absl::InternalError("leader election: the lease row is missing");
  LeaderInfo info;
  if (!absl::SimpleAtoi(rows[0][0], &info.epoch)) {
    return absl::InternalError(absl::StrCat("leader election: epoch '", rows[0][0], "'"));
  }
  info.holder = rows[0][1];
  info.address = rows[0][2];
  info.live = rows[0][3] == "t";
  return info;
}

int64_t LeaderElection::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

bool LeaderElection::Valid() const {
  absl::MutexLock lock(&mu_);
  return epoch_ != 0 && !lost_ &&
         std::chrono::steady_clock::now() - renewed_ < absl::ToChronoNanoseconds(options_.lease);
}

absl::Status LeaderElection::Fence(DbConnection& writer) {
  const int64_t ours = epoch();
  int64_t stored = 0;
  std::string address;
  {
    ASSIGN_OR_RETURN(Statement fence, writer.Prepare(kFence, "leadership fence"));
    ASSIGN_OR_RETURN(bool has_row, fence.Step());
    if (!has_row) return absl::InternalError("store: fenced: the lease row is missing");
    stored = fence.ColumnInt64(0);
    address = fence.ColumnText(1);
  }
  // The database first: a newer epoch is the more telling reason.
  if (stored != ours) {
    Lose(absl::StrCat("now ", stored, " at ", address));
    return absl::FailedPreconditionError(
        absl::StrCat("store: fenced: leadership epoch ", ours, " was superseded by ", stored));
  }
  if (!Valid()) {
    Lose(absl::StrCat("not renewed for ", absl::FormatDuration(options_.lease)));
    return absl::FailedPreconditionError(absl::StrCat("store: fenced: leadership epoch ", ours,
                                                      " was not renewed for ",
                                                      absl::FormatDuration(options_.lease)));
  }
  return absl::OkStatus();
}

void LeaderElection::Lose(const std::string& detail) {
  std::function<void(const std::string&)> on_lost;
  int64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    if (lost_) return;
    lost_ = true;
    on_lost = std::move(on_lost_);
    epoch = epoch_;
  }
  if (on_lost) on_lost(absl::StrCat("lost leadership (epoch ", epoch, ", ", detail, ")"));
}

void LeaderElection::StartRenewing(std::function<void(const std::string& message)> on_lost) {
  {
    absl::MutexLock lock(&mu_);
    on_lost_ = std::move(on_lost);
  }
  renewer_ = std::thread([this] { RenewLoop(); });
}

void LeaderElection::RenewLoop() {
  bool reported_outage = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.renew_interval);
      if (stopping_ || lost_) return;
    }
    // A leader that ran nothing for the lease (paused, starved) may have been deposed: it stops
    // before asking, as a renewal now could succeed only by luck.
    if (!Valid()) {
      absl::StatusOr<LeaderInfo> now = Current();
      Lose(now.ok() && now->epoch != epoch()
               ? absl::StrCat("now ", now->epoch, " at ", now->address)
               : absl::StrCat("not renewed for ", absl::FormatDuration(options_.lease)));
      return;
    }
    const absl::Status renewed = Renew();
    if (absl::IsFailedPrecondition(renewed)) {
      absl::StatusOr<LeaderInfo> now = Current();
      Lose(now.ok() ? absl::StrCat("now ", now->epoch, " at ", now->address)
                    : std::string(renewed.message()));
      return;
    }
    if (!renewed.ok() && !reported_outage) {
      // The database is away: the lease holds for its TTL, after which Valid() ends the loop.
      std::cerr << "tessera-coordinator: renewing the leader lease: " << renewed.message()
                << std::endl;
    }
    reported_outage = !renewed.ok();
  }
}

}  // namespace tessera::coordinator
