// PostgresDatabase (postgres_database.h): libpq connections, statements prepared on the server,
// binary parameters and results, the error mapping and the transaction of each group commit.
// Thread safety as the header says.
#include "coordinator/store/postgres_database.h"

#include <endian.h>
#include <libpq-fe.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "coordinator/store/postgres_client.h"

namespace tessera::coordinator {
namespace {

// Type OIDs of pg_type (catalog/pg_type_d.h is a server header, not libpq-dev's).
constexpr Oid kBoolOid = 16;
constexpr Oid kByteaOid = 17;
constexpr Oid kInt8Oid = 20;
constexpr Oid kInt2Oid = 21;
constexpr Oid kInt4Oid = 23;
constexpr Oid kTextOid = 25;
constexpr Oid kFloat4Oid = 700;
constexpr Oid kFloat8Oid = 701;

constexpr int kBinary = 1;

absl::Status ResultStatus(PGconn* conn, const PGresult* result, absl::string_view operation) {
  return PgFailure(conn, result, absl::StrCat("store: ", operation));
}

// Owns a PGresult.
struct ResultDeleter {
  void operator()(PGresult* result) const { PQclear(result); }
};
using Result = std::unique_ptr<PGresult, ResultDeleter>;

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

}  // namespace

std::string RedactPostgresUrl(const std::string& url) {
  std::string redacted = url;
  const size_t scheme = redacted.find("://");
  if (scheme != std::string::npos) {
    const size_t authority = scheme + 3;
    const size_t at = redacted.find('@', authority);
    const size_t slash = redacted.find('/', authority);
    if (at != std::string::npos && (slash == std::string::npos || at < slash)) {
      const size_t colon = redacted.find(':', authority);
      if (colon != std::string::npos && colon < at) {
        redacted.replace(colon + 1, at - colon - 1, "***");
      }
    }
  }
  const size_t password = redacted.find("password=");
  if (password != std::string::npos) {
    const size_t start = password + std::strlen("password=");
    const size_t end = redacted.find_first_of("& ", start);
    redacted.replace(start, (end == std::string::npos ? redacted.size() : end) - start, "***");
  }
  return redacted;
}

std::string PostgresParameters(absl::string_view sql, int* max_parameter) {
  std::string out;
  out.reserve(sql.size());
  *max_parameter = 0;
  bool quoted = false;
  for (size_t i = 0; i < sql.size(); ++i) {
    const char c = sql[i];
    if (c == '\'') quoted = !quoted;
    if (c != '?' || quoted || i + 1 >= sql.size() ||
        !std::isdigit(static_cast<unsigned char>(sql[i + 1]))) {
      out.push_back(c);
      continue;
    }
    int number = 0;
    out.push_back('$');
    while (i + 1 < sql.size() && std::isdigit(static_cast<unsigned char>(sql[i + 1]))) {
      number = number * 10 + (sql[++i] - '0');
      out.push_back(sql[i]);
    }
    *max_parameter = std::max(*max_parameter, number);
  }
  return out;
}

std::string PostgresDdl(absl::string_view sql) {
  static const std::pair<absl::string_view, absl::string_view> kRewrites[] = {
      {"WITHOUT ROWID", ""},
      {"INTEGER", "BIGINT"},
      {"REAL", "DOUBLE PRECISION"},
      {"BLOB", "BYTEA"},
  };
  std::string out;
  out.reserve(sql.size() + 32);
  bool quoted = false;
  for (size_t i = 0; i < sql.size();) {
    if (sql[i] == '\'') quoted = !quoted;
    const bool word_start = !quoted && (i == 0 || !IsWordChar(sql[i - 1]));
    bool rewritten = false;
    if (word_start) {
      for (const auto& [from, to] : kRewrites) {
        const size_t end = i + from.size();
        if (sql.substr(i, from.size()) == from && (end == sql.size() || !IsWordChar(sql[end]))) {
          out.append(to.data(), to.size());
          i = end;
          rewritten = true;
          break;
        }
      }
    }
    if (!rewritten) out.push_back(sql[i++]);
  }
  return out;
}

// A statement of a PostgresConnection: parameters kept until the first Step, which prepares it
// on the server (first use only) and executes it; the rows are then read from the result.
class PostgresStatement final : public DbStatement {
 public:
  PostgresStatement(PGconn* conn, std::string name, std::string sql, int parameters)
      : conn_(conn), name_(std::move(name)), sql_(std::move(sql)), params_(parameters) {}

  void Bind(int index, int64_t value) override {
    const uint64_t big_endian = htobe64(static_cast<uint64_t>(value));
    Set(index, kInt8Oid, absl::string_view(reinterpret_cast<const char*>(&big_endian), 8));
  }
  void BindDouble(int index, double value) override {
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint64_t big_endian = htobe64(bits);
    Set(index, kFloat8Oid, absl::string_view(reinterpret_cast<const char*>(&big_endian), 8));
  }
  void BindText(int index, absl::string_view value) override { Set(index, kTextOid, value); }
  void BindNull(int index) override {
    if (Valid(index)) params_[index - 1] = Param{};
  }
  void BindBlob(int index, absl::string_view bytes) override { Set(index, kByteaOid, bytes); }

  absl::StatusOr<bool> Step() override {
    if (result_ != nullptr) return ++row_ < PQntuples(result_.get());
    if (!bind_error_.empty()) {
      return absl::InternalError(absl::StrCat("store: ", operation(), ": ", bind_error_));
    }
    const int count = static_cast<int>(params_.size());
    std::vector<const char*> values(count);
    std::vector<int> lengths(count);
    std::vector<int> formats(count, kBinary);
    for (int i = 0; i < count; ++i) {
      values[i] = params_[i].set ? params_[i].value.data() : nullptr;
      lengths[i] = static_cast<int>(params_[i].value.size());
    }
    if (!prepared_) {
      std::vector<Oid> types(count);
      for (int i = 0; i < count; ++i) types[i] = params_[i].type;
      Result prepared(PQprepare(conn_, name_.c_str(), sql_.c_str(), count, types.data()));
      if (PQresultStatus(prepared.get()) != PGRES_COMMAND_OK) {
        return ResultStatus(conn_, prepared.get(), operation());
      }
      prepared_ = true;
    }
    result_.reset(PQexecPrepared(conn_, name_.c_str(), count, values.data(), lengths.data(),
                                 formats.data(), kBinary));
    const ExecStatusType status = PQresultStatus(result_.get());
    if (status == PGRES_COMMAND_OK) {
      changes_ = std::strtoll(PQcmdTuples(result_.get()), nullptr, 10);
      return false;
    }
    if (status != PGRES_TUPLES_OK) {
      absl::Status failed = ResultStatus(conn_, result_.get(), operation());
      result_.reset();
      return failed;
    }
    changes_ = std::strtoll(PQcmdTuples(result_.get()), nullptr, 10);
    row_ = 0;
    return PQntuples(result_.get()) > 0;
  }
  int64_t Changes() override { return changes_; }

  int64_t ColumnInt64(int column) override {
    if (ColumnIsNull(column)) return 0;
    const char* value = PQgetvalue(result_.get(), row_, column);
    switch (PQftype(result_.get(), column)) {
      case kInt8Oid: {
        uint64_t big_endian = 0;
        std::memcpy(&big_endian, value, 8);
        return static_cast<int64_t>(be64toh(big_endian));
      }
      case kInt4Oid: {
        uint32_t big_endian = 0;
        std::memcpy(&big_endian, value, 4);
        return static_cast<int32_t>(be32toh(big_endian));
      }
      case kInt2Oid: {
        uint16_t big_endian = 0;
        std::memcpy(&big_endian, value, 2);
        return static_cast<int16_t>(be16toh(big_endian));
      }
      case kBoolOid:
        return value[0] != 0 ? 1 : 0;
      default:
        return static_cast<int64_t>(ColumnDouble(column));
    }
  }
  double ColumnDouble(int column) override {
    if (ColumnIsNull(column)) return 0;
    const char* value = PQgetvalue(result_.get(), row_, column);
    switch (PQftype(result_.get(), column)) {
      case kFloat8Oid: {
        uint64_t big_endian = 0;
        std::memcpy(&big_endian, value, 8);
        const uint64_t bits = be64toh(big_endian);
        double number = 0;
        std::memcpy(&number, &bits, 8);
        return number;
      }
      case kFloat4Oid: {
        uint32_t big_endian = 0;
        std::memcpy(&big_endian, value, 4);
        const uint32_t bits = be32toh(big_endian);
        float number = 0;
        std::memcpy(&number, &bits, 4);
        return number;
      }
      case kInt8Oid:
      case kInt4Oid:
      case kInt2Oid:
      case kBoolOid:
        return static_cast<double>(ColumnInt64(column));
      default:
        return 0;
    }
  }
  bool ColumnIsNull(int column) override {
    return !HasRow() || PQgetisnull(result_.get(), row_, column) != 0;
  }
  absl::string_view ColumnBytes(int column) override {
    if (ColumnIsNull(column)) return {};
    return {PQgetvalue(result_.get(), row_, column),
            static_cast<size_t>(PQgetlength(result_.get(), row_, column))};
  }
  void Reset() override {
    result_.reset();
    row_ = -1;
    changes_ = 0;
    bind_error_.clear();
    for (Param& param : params_) param = Param{};
  }

 private:
  struct Param {
    bool set = false;
    // The type of the first binding is the one the statement is prepared with (0: inferred).
    Oid type = 0;
    std::string value;
  };

  bool Valid(int index) {
    if (index >= 1 && index <= static_cast<int>(params_.size())) return true;
    if (bind_error_.empty()) {
      bind_error_ = absl::StrCat("parameter ", index, " is out of range (the statement has ",
                                 params_.size(), ")");
    }
    return false;
  }
  void Set(int index, Oid type, absl::string_view value) {
    if (!Valid(index)) return;
    Param& param = params_[index - 1];
    param.set = true;
    param.type = type;
    param.value.assign(value.data(), value.size());
  }
  bool HasRow() const { return result_ != nullptr && row_ >= 0 && row_ < PQntuples(result_.get()); }

  PGconn* const conn_;
  const std::string name_;
  const std::string sql_;
  std::vector<Param> params_;
  bool prepared_ = false;
  Result result_;
  int row_ = -1;
  int64_t changes_ = 0;
  std::string bind_error_;
};

// One libpq connection and its prepared statements.
class PostgresConnection final : public DbConnection {
 public:
  PostgresConnection(PGconn* conn, std::string name) : conn_(conn), name_(std::move(name)) {}
  ~PostgresConnection() override {
    statements_.clear();
    PQfinish(conn_);
  }

  SqlDialect dialect() const override { return SqlDialect::kPostgres; }

  absl::StatusOr<Statement> Prepare(absl::string_view sql, absl::string_view operation) override {
    auto it = statements_.find(sql);
    if (it == statements_.end()) {
      int parameters = 0;
      std::string translated = PostgresParameters(sql, &parameters);
      auto statement = std::make_unique<PostgresStatement>(
          conn_, absl::StrCat("tessera_", statements_.size() + 1), std::move(translated),
          parameters);
      it = statements_.emplace(std::string(sql), std::move(statement)).first;
    }
    it->second->set_operation(operation);
    return Statement(it->second.get());
  }

  absl::Status Exec(absl::string_view sql, absl::string_view operation) override {
    Result result(PQexec(conn_, PostgresDdl(sql).c_str()));
    const ExecStatusType status = PQresultStatus(result.get());
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
      return ResultStatus(conn_, result.get(), operation);
    }
    return absl::OkStatus();
  }

  absl::Status Begin(absl::string_view operation) override { return Exec("BEGIN", operation); }

  absl::Status FinishTransaction(absl::Status status, absl::string_view operation) override {
    if (status.ok()) {
      // COMMIT of a transaction that failed reports success and rolls back: ask first.
      if (PQtransactionStatus(conn_) == PQTRANS_INERROR) {
        status = absl::InternalError(
            absl::StrCat("store: ", operation, ": the transaction failed before its commit"));
      } else {
        status = Exec("COMMIT", operation);
        if (status.ok()) return status;
      }
    }
    if (PQtransactionStatus(conn_) != PQTRANS_IDLE && PQstatus(conn_) == CONNECTION_OK) {
      Result rollback(PQexec(conn_, "ROLLBACK"));
    }
    return status;
  }

  // Whether the last statement left the transaction usable (false once a statement failed).
  bool TransactionFailed() const { return PQtransactionStatus(conn_) == PQTRANS_INERROR; }
  bool InTransaction() const {
    const PGTransactionStatusType status = PQtransactionStatus(conn_);
    return status == PQTRANS_INTRANS || status == PQTRANS_INERROR;
  }

  // Re-establishes a broken connection (its prepared statements are gone with it). A reader
  // that stays broken needs no status from here: its read's first statement fails UNAVAILABLE.
  // An idle connection whose server went away (a restart) still says CONNECTION_OK until it
  // reads: PQconsumeInput reads what is waiting without blocking, so the break is found here
  // rather than by the next read or batch. Twice: the first call may read only the server's
  // farewell message (taken as a notice while idle), the second finds the end of the stream.
  void ReconnectIfBroken() {
    if (PgReconnectIfBroken(conn_)) statements_.clear();
  }
  absl::Status EnsureConnected() {
    ReconnectIfBroken();
    if (PQstatus(conn_) != CONNECTION_OK) {
      return absl::UnavailableError(
          absl::StrCat("store: reconnect to ", name_, ": ", PgMessage(PQerrorMessage(conn_))));
    }
    return absl::OkStatus();
  }

  PGconn* conn() const { return conn_; }

 private:
  PGconn* const conn_;
  const std::string name_;  // the redacted URL
  absl::flat_hash_map<std::string, std::unique_ptr<PostgresStatement>> statements_;
};

namespace {

absl::StatusOr<std::unique_ptr<PostgresConnection>> Connect(
    const PostgresDatabase::Options& options, const std::string& redacted) {
  const std::string timeout = absl::StrCat(options.connect_timeout_seconds);
  // NOTICEs (CREATE TABLE IF NOT EXISTS of a table that exists) would go to stderr. A
  // transaction left open for 5 s is a paused or hung coordinator (a group commit never waits
  // in one): the server ends it, releasing the leader lease's row lock (leader_election.h) so
  // that a standby's takeover is not held up by a deposed leader.
  //
  // Every execution of a prepared statement is planned for its values (force_custom_plan).
  // After five executions PostgreSQL may switch to a generic plan, and for the scheduler's
  // `state IN (?1, ...)` listings that plan assumes each parameter matches an even share of the
  // states seen, so once autovacuum has analyzed a history of ended jobs it scans the whole jobs
  // table, every pass: 2.4 ms at 2,000 jobs and growing with the history, against 0.07 ms through
  // jobs_by_state with the values known (docs/performance.md). Planning the store's small
  // statements each time costs tens of microseconds.
  std::vector<const char*> keys = {"dbname", "connect_timeout", "application_name", "options"};
  std::vector<const char*> values = {
      options.url.c_str(), timeout.c_str(), "tessera-coordinator",
      "-c client_min_messages=warning -c idle_in_transaction_session_timeout=5000 "
      "-c plan_cache_mode=force_custom_plan"};
  if (!options.password.empty()) {
    keys.push_back("password");
    values.push_back(options.password.c_str());
  }
  keys.push_back(nullptr);
  values.push_back(nullptr);
  PGconn* conn = PQconnectdbParams(keys.data(), values.data(), /*expand_dbname=*/1);
  auto connection = std::make_unique<PostgresConnection>(conn, redacted);
  if (conn == nullptr || PQstatus(conn) != CONNECTION_OK) {
    const std::string detail = conn != nullptr ? PgMessage(PQerrorMessage(conn)) : "out of memory";
    std::string message = absl::StrCat("store: connect to ", redacted, ": ", detail);
    if (absl::StrContains(detail, "password authentication failed") ||
        absl::StrContains(detail, "no password supplied")) {
      return absl::PermissionDeniedError(std::move(message));
    }
    if (absl::StrContains(detail, "does not exist")) {
      return absl::FailedPreconditionError(std::move(message));
    }
    if (absl::StrContains(detail, "invalid") || absl::StrContains(detail, "missing")) {
      return absl::InvalidArgumentError(std::move(message));
    }
    return absl::UnavailableError(std::move(message));
  }
  return connection;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostgresDatabase>> PostgresDatabase::Open(const Options& options) {
  const std::string redacted = RedactPostgresUrl(options.url);
  ASSIGN_OR_RETURN(std::unique_ptr<PostgresConnection> writer, Connect(options, redacted));
  const std::string operation = absl::StrCat("open ", redacted);
  {
    // The writer's commits must be durable before they return, as SQLite's synchronous=FULL.
    ASSIGN_OR_RETURN(Statement show, writer->Prepare("SHOW synchronous_commit", operation));
    ASSIGN_OR_RETURN(bool has_row, show.Step());
    const std::string setting = has_row ? show.ColumnText(0) : "";
    if (setting == "off") {
      return absl::FailedPreconditionError(
          absl::StrCat("store: ", operation,
                       ": synchronous_commit is 'off'; a commit must be durable when it "
                       "returns: set it to 'on'"));
    }
  }
  if (options.migrate) RETURN_IF_ERROR(options.migrate(*writer));
  std::unique_ptr<PostgresDatabase> database(new PostgresDatabase(std::move(writer)));
  for (int i = 0; i < std::max(1, options.readers); ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<PostgresConnection> reader, Connect(options, redacted));
    database->readers_.push_back(std::move(reader));
  }
  absl::MutexLock lock(&database->read_mu_);
  for (auto& reader : database->readers_) database->idle_readers_.push_back(reader.get());
  return database;
}

PostgresDatabase::PostgresDatabase(std::unique_ptr<PostgresConnection> writer)
    : writer_(std::move(writer)) {}

PostgresDatabase::~PostgresDatabase() = default;

DbConnection* PostgresDatabase::AcquireReader() {
  PostgresConnection* reader = nullptr;
  {
    absl::MutexLock lock(&read_mu_);
    read_mu_.Await(absl::Condition(
        +[](std::vector<PostgresConnection*>* idle) { return !idle->empty(); }, &idle_readers_));
    reader = idle_readers_.back();
    idle_readers_.pop_back();
  }
  reader->ReconnectIfBroken();
  return reader;
}

void PostgresDatabase::ReleaseReader(DbConnection* connection) {
  auto* reader = static_cast<PostgresConnection*>(connection);
  // A read leaves no transaction open; one that did (a caller's bug) must not leak its snapshot
  // into the next read.
  if (reader->InTransaction()) {
    Result rollback(PQexec(reader->conn(), "ROLLBACK"));
  }
  absl::MutexLock lock(&read_mu_);
  idle_readers_.push_back(reader);
}

DatabaseCommitStats PostgresDatabase::RunBatch(const std::vector<QueuedWrite*>& batch) {
  absl::MutexLock lock(&mu_);
  const absl::Time start = absl::Now();
  const double cpu_start = ThreadCpuSeconds();
  const std::string operation = absl::StrCat("group commit of ", batch.size(), " writes");
  auto fail_all = [&](const absl::Status& status) {
    for (QueuedWrite* write : batch) write->status = status;
    return DatabaseCommitStats{};
  };
  if (absl::Status connected = writer_->EnsureConnected(); !connected.ok()) {
    return fail_all(connected);
  }
  absl::Status begun = writer_->Begin(operation);
  if (begun.ok()) begun = CheckFence(*writer_);
  if (!begun.ok()) {
    // A refused fence leaves the transaction open (and maybe failed): end it, store nothing.
    return fail_all(writer_->FinishTransaction(std::move(begun), operation));
  }
  // First the whole batch without savepoints, as SQLite's: nearly every batch applies whole.
  absl::Status failed;
  for (QueuedWrite* write : batch) {
    failed = write->apply(*writer_);
    if (!failed.ok()) break;
  }
  if (failed.ok()) {
    const absl::Status committed = writer_->FinishTransaction(absl::OkStatus(), operation);
    for (QueuedWrite* write : batch) write->status = committed;
    if (!committed.ok()) return {};
    return DatabaseCommitStats{.seconds = absl::ToDoubleSeconds(absl::Now() - start),
                               .cpu_seconds = ThreadCpuSeconds() - cpu_start,
                               .writes = static_cast<int>(batch.size())};
  }
  // Rolled back; a write's failure that is the connection's is every write's.
  failed = writer_->FinishTransaction(std::move(failed), operation);
  if (batch.size() == 1 || PQstatus(writer_->conn()) != CONNECTION_OK) return fail_all(failed);
  const absl::Status applied = ApplyWithSavepoints(batch, operation);
  if (!applied.ok()) {
    for (QueuedWrite* write : batch) {
      if (write->status.ok()) write->status = applied;
    }
    return {};
  }
  return DatabaseCommitStats{.seconds = absl::ToDoubleSeconds(absl::Now() - start),
                             .cpu_seconds = ThreadCpuSeconds() - cpu_start,
                             .writes = static_cast<int>(batch.size())};
}

absl::Status PostgresDatabase::ApplyWithSavepoints(const std::vector<QueuedWrite*>& batch,
                                                   absl::string_view operation) {
  RETURN_IF_ERROR(writer_->Begin(operation));
  if (absl::Status fenced = CheckFence(*writer_); !fenced.ok()) {
    for (QueuedWrite* write : batch) write->status = fenced;
    return writer_->FinishTransaction(std::move(fenced), operation);
  }
  for (QueuedWrite* write : batch) {
    absl::Status status = writer_->Exec("SAVEPOINT write", operation);
    if (status.ok()) status = write->apply(*writer_);
    if (status.ok()) {
      status = writer_->Exec("RELEASE SAVEPOINT write", operation);
    } else if (PQstatus(writer_->conn()) == CONNECTION_OK) {
      // Back to before this write; the transaction is usable again.
      const absl::Status undone = writer_->Exec("ROLLBACK TO SAVEPOINT write", operation);
      if (!undone.ok()) return writer_->FinishTransaction(undone, operation);
    }
    write->status = std::move(status);
    if (PQstatus(writer_->conn()) != CONNECTION_OK) {
      // Nothing of the batch is stored, and the writes after this one were never tried.
      const absl::Status lost = write->status.ok()
                                    ? absl::UnavailableError(absl::StrCat(
                                          "store: ", operation, ": the connection was lost"))
                                    : write->status;
      for (QueuedWrite* other : batch) other->status = lost;
      return lost;
    }
  }
  return writer_->FinishTransaction(absl::OkStatus(), operation);
}

}  // namespace tessera::coordinator
