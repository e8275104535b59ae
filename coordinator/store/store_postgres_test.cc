// What only the PostgreSQL backend has (postgres_database.cc, store_migrations.cc): the common
// dialect's rewriting, the redacted URL, migrations fresh and on reopen (one coordinator after
// another, and two at once), a newer schema refused, a failed write of a batch rolled back alone
// on a server's constraint, the error codes of an unreachable server and of a non-durable one,
// and reconnecting after the server dropped the store's connections. The suites of
// store_{jobs,events,metrics,commit}_test run on both backends.
//
// Thread safety: each test owns its store and database; the threads a test starts use the store
// as the coordinator's threads do.
#include <libpq-fe.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_matchers.h"
#include "coordinator/store/postgres_database.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/postgres_fixture.h"
#include "tests/util/free_port.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::SizeIs;

TEST(PostgresDialectTest, NumberedParametersBecomeDollarParameters) {
  int max_parameter = 0;
  EXPECT_EQ(PostgresParameters("SELECT a FROM t WHERE b = ?1 AND c < ?12 + ?2", &max_parameter),
            "SELECT a FROM t WHERE b = $1 AND c < $12 + $2");
  EXPECT_EQ(max_parameter, 12);
  EXPECT_EQ(PostgresParameters("SELECT '?1', x FROM t WHERE y = ?3", &max_parameter),
            "SELECT '?1', x FROM t WHERE y = $3")
      << "quoted text is left alone";
  EXPECT_EQ(max_parameter, 3);
  EXPECT_EQ(PostgresParameters("SELECT 1", &max_parameter), "SELECT 1");
  EXPECT_EQ(max_parameter, 0);
}

TEST(PostgresDialectTest, DdlTypesAreRewrittenAsWholeWords) {
  EXPECT_EQ(PostgresDdl("CREATE TABLE t (a INTEGER NOT NULL, b REAL, c BLOB) WITHOUT ROWID;"),
            "CREATE TABLE t (a BIGINT NOT NULL, b DOUBLE PRECISION, c BYTEA) ;");
  EXPECT_EQ(PostgresDdl("CREATE TABLE INTEGERS (REALM TEXT DEFAULT 'BLOB')"),
            "CREATE TABLE INTEGERS (REALM TEXT DEFAULT 'BLOB')");
}

TEST(PostgresDialectTest, UrlPasswordsAreRedacted) {
  EXPECT_EQ(RedactPostgresUrl("postgresql://tessera:s3cret@db:5432/state"),
            "postgresql://tessera:***@db:5432/state");
  EXPECT_EQ(RedactPostgresUrl("postgresql://db/state?user=u&password=s3cret&sslmode=require"),
            "postgresql://db/state?user=u&password=***&sslmode=require");
  EXPECT_EQ(RedactPostgresUrl("postgresql://tessera@db/state"), "postgresql://tessera@db/state");
}

// A closed loopback port: nothing answers there.
std::string UnreachableUrl(absl::string_view credentials) {
  absl::StatusOr<int> port = tessera::testing::PickFreePort();
  EXPECT_THAT(port, IsOk());
  return absl::StrCat("postgresql://", credentials, "@127.0.0.1:", port.value_or(1), "/state");
}

TEST(PostgresOpenTest, UnreachableServerIsUnavailableAndHidesThePassword) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(UnreachableUrl("tessera:s3cret"));
  EXPECT_THAT(store, StatusIs(absl::StatusCode::kUnavailable,
                              AllOf(HasSubstr("127.0.0.1"), HasSubstr("tessera:***@"),
                                    Not(HasSubstr("s3cret")))));
}

TEST(PostgresOpenTest, MissingPasswordFileIsNamed) {
  absl::StatusOr<std::unique_ptr<Store>> store =
      Store::Open(UnreachableUrl("tessera"), StoreOptions{.password_file = "/nonexistent/pw"});
  EXPECT_THAT(store, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("/nonexistent/pw")));
}

// Tests against the private cluster, one database each.
class PostgresStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tessera::testing::PostgresCluster& cluster = tessera::testing::PostgresCluster::Shared();
    url_ = cluster.NewDatabase();
    if (url_.empty()) GTEST_SKIP() << "no PostgreSQL server: " << cluster.Reason();
  }

  // Runs `sql` behind the store's back; the first column of its first row ("" for none).
  std::string Raw(const std::string& sql) {
    PGconn* conn = PQconnectdb(url_.c_str());
    EXPECT_EQ(PQstatus(conn), CONNECTION_OK) << PQerrorMessage(conn);
    PGresult* result = PQexec(conn, sql.c_str());
    const ExecStatusType status = PQresultStatus(result);
    EXPECT_TRUE(status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK)
        << sql << ": " << PQresultErrorMessage(result);
    std::string value;
    if (status == PGRES_TUPLES_OK && PQntuples(result) > 0) value = PQgetvalue(result, 0, 0);
    PQclear(result);
    PQfinish(conn);
    return value;
  }

  std::string url_;
};

TEST_F(PostgresStoreTest, FreshSchemaThenIdempotentReopens) {
  {
    std::unique_ptr<Store> store = OpenOrDie(url_);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 2);
  }
  EXPECT_EQ(Raw("SELECT version FROM schema_version"), absl::StrCat(Store::kSchemaVersion));
  EXPECT_EQ(Raw("SELECT COUNT(*) FROM schema_version"), "1");
  // 64-bit columns where SQLite's INTEGER is 64-bit.
  EXPECT_EQ(Raw("SELECT data_type FROM information_schema.columns "
                "WHERE table_name = 'jobs' AND column_name = 'create_time_ns'"),
            "bigint");
  EXPECT_EQ(Raw("SELECT data_type FROM information_schema.columns "
                "WHERE table_name = 'job_events' AND column_name = 'last_sequence'"),
            "bigint");
  EXPECT_EQ(Raw("SELECT data_type FROM information_schema.columns "
                "WHERE table_name = 'queue_usage' AND column_name = 'gpu_seconds'"),
            "double precision");
  for (int reopen = 0; reopen < 2; ++reopen) {
    std::unique_ptr<Store> store = OpenOrDie(url_);
    ASSERT_NE(store, nullptr);
    EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(2)));
  }
  EXPECT_EQ(Raw("SELECT COUNT(*) FROM schema_version"), "1");
}

TEST_F(PostgresStoreTest, CoordinatorsOpeningAtOnceMigrateOneAfterTheOther) {
  constexpr int kOpeners = 4;
  std::vector<absl::Status> opened(kOpeners);
  std::vector<std::thread> threads;
  for (int i = 0; i < kOpeners; ++i) {
    threads.emplace_back([&, i] { opened[i] = Store::Open(url_).status(); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const absl::Status& status : opened) EXPECT_THAT(status, IsOk());
  EXPECT_EQ(Raw("SELECT COUNT(*) FROM schema_version"), "1");
}

TEST_F(PostgresStoreTest, NewerSchemaIsRefused) {
  ASSERT_NE(OpenOrDie(url_), nullptr);
  Raw("UPDATE schema_version SET version = 99");
  EXPECT_THAT(Store::Open(url_),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("schema version 99"), HasSubstr("127.0.0.1"))));
}

TEST_F(PostgresStoreTest, NonDurableServerIsRefused) {
  Raw(absl::StrCat("ALTER DATABASE ", url_.substr(url_.rfind('/') + 1),
                   " SET synchronous_commit = off"));
  EXPECT_THAT(Store::Open(url_),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("synchronous_commit")));
}

// A write the server rejects in the middle of a batch is rolled back alone (the savepoint retry),
// and its caller sees the server's reason.
TEST_F(PostgresStoreTest, AWriteTheServerRejectsFailsAloneInItsBatch) {
  std::unique_ptr<Store> store = OpenOrDie(url_);
  ASSERT_NE(store, nullptr);
  Raw("ALTER TABLE step_metrics ADD CONSTRAINT step_not_negative CHECK (step >= 0)");
  std::vector<JobWrite> writes(3);
  for (int i = 0; i < 3; ++i) {
    writes[i].job_id = absl::StrCat("job-", i);
    writes[i].job = MakeJob(writes[i].job_id, v1::JOB_STATE_PENDING, i);
    writes[i].events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
    writes[i].metrics.push_back(Metrics(i == 1 ? -1 : 1, 0.5));
  }
  std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results = store->CommitAll(writes);
  ASSERT_THAT(results, SizeIs(3));
  EXPECT_THAT(results[0], IsOk());
  EXPECT_THAT(results[1],
              StatusIs(absl::StatusCode::kInternal,
                       AllOf(HasSubstr("step metrics for job-1"), HasSubstr("step_not_negative"))));
  EXPECT_THAT(results[2], IsOk());
  EXPECT_THAT(store->GetJob("job-1"), StatusIs(absl::StatusCode::kNotFound, ::testing::_));
  EXPECT_THAT(store->LastEventSequence("job-1"), IsOkAndHolds(0));
  EXPECT_THAT(store->ReadMetrics("job-2", 0, 0), IsOkAndHolds(SizeIs(1)));
  // A unique key violation is ALREADY_EXISTS, as on SQLite.
  JobWrite duplicate;
  duplicate.job_id = "job-3";
  duplicate.job = MakeJob("job-3", v1::JOB_STATE_PENDING, 3);
  duplicate.request_id = "req";
  ASSERT_THAT(store->Commit(duplicate), IsOk());
  duplicate.job_id = "job-4";
  duplicate.job = MakeJob("job-4", v1::JOB_STATE_PENDING, 4);
  EXPECT_THAT(store->Commit(duplicate), StatusIs(absl::StatusCode::kAlreadyExists, ::testing::_));
}

// The server ends the store's sessions (a failover of the database, an administrator): the write
// that meets the break fails UNAVAILABLE, and the store reconnects for the next ones.
TEST_F(PostgresStoreTest, ReconnectsAfterTheServerDropsItsConnections) {
  std::unique_ptr<Store> store = OpenOrDie(url_);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1), 1);
  EXPECT_EQ(Raw("SELECT COUNT(pg_terminate_backend(pid)) > 0 FROM pg_stat_activity "
                "WHERE application_name = 'tessera-coordinator'"),
            "t");
  JobWrite write;
  write.job_id = "job-a";
  write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
  absl::StatusOr<std::vector<v1::JobEvent>> first = store->Commit(write);
  if (!first.ok()) {
    EXPECT_THAT(first, StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
    first = store->Commit(write);
  }
  ASSERT_THAT(first, IsOk());
  EXPECT_EQ(first->front().sequence(), 2) << "the failed write stored nothing";
  // Each reader meets the break once, then reconnects.
  int unavailable = 0;
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", 0, 0);
    if (!events.ok()) {
      EXPECT_THAT(events, StatusIs(absl::StatusCode::kUnavailable, ::testing::_));
      ++unavailable;
      continue;
    }
    EXPECT_THAT(*events, SizeIs(2));
  }
  EXPECT_LE(unavailable, 4);
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(2)));
}

}  // namespace
}  // namespace tessera::coordinator
