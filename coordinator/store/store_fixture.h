// Helpers shared by the Store's tests (store_*_test.cc): jobs, events and metric points to
// write, a store opened or the test failed, a submitted job, the ids and sequences of what was
// read, raw SQL on a database file behind the store's back, and StoreBackendTest, which runs a
// test on SQLite and on PostgreSQL.
//
// Thread safety: plain functions; each test uses them from its own threads as it would the
// Store (the raw SQL opens a connection of its own per call).
#pragma once

#include <libpq-fe.h>
#include <sqlite3.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/postgres_fixture.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {

inline v1::Job MakeJob(const std::string& job_id, v1::JobState state, int64_t create_seconds) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_state(state);
  job.mutable_spec()->set_name("job-" + std::to_string(create_seconds));
  job.mutable_spec()->set_priority(static_cast<int32_t>(create_seconds % 3));
  job.mutable_create_time()->set_seconds(create_seconds);
  return job;
}

inline v1::JobEvent StateEvent(v1::JobState from, v1::JobState to) {
  v1::JobEvent event;
  event.mutable_state_change()->set_previous_state(from);
  event.mutable_state_change()->set_new_state(to);
  return event;
}

inline v1::StepMetrics Metrics(int64_t step, double loss) {
  v1::StepMetrics metrics;
  metrics.set_step(step);
  metrics.set_loss(loss);
  return metrics;
}

inline std::unique_ptr<Store> OpenOrDie(const std::string& path) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  EXPECT_THAT(store, ::tessera::testing::IsOk());
  return store.ok() ? std::move(store).value() : nullptr;
}

// Submits a job with `events` state events (all PENDING -> PENDING).
inline void SubmitJob(Store& store, const v1::Job& job, int events = 0) {
  JobWrite write;
  write.job_id = job.job_id();
  write.job = job;
  for (int i = 0; i < events; ++i) {
    write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
  }
  ASSERT_THAT(store.Commit(write), ::tessera::testing::IsOk());
}

inline std::vector<int64_t> Sequences(const std::vector<v1::JobEvent>& events) {
  std::vector<int64_t> sequences;
  for (const v1::JobEvent& event : events) sequences.push_back(event.sequence());
  return sequences;
}

inline std::vector<std::string> JobIds(const std::vector<v1::Job>& jobs) {
  std::vector<std::string> ids;
  for (const v1::Job& job : jobs) ids.push_back(job.job_id());
  return ids;
}

// Runs `sql` on the database file behind the store's back.
inline void RawExec(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* error = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, &error), SQLITE_OK)
      << (error != nullptr ? error : "");
  sqlite3_free(error);
  sqlite3_close(db);
}

// The first column of the first row `sql` returns, read behind the store's back ("" for none).
inline std::string RawQuery(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  std::string value;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  if (sqlite3_step(stmt) == SQLITE_ROW && sqlite3_column_text(stmt, 0) != nullptr) {
    value = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return value;
}

// Runs `sql` on a PostgreSQL database behind the store's back (its own connection).
inline void RawPostgresExec(const std::string& url, const char* sql) {
  PGconn* conn = PQconnectdb(url.c_str());
  ASSERT_EQ(PQstatus(conn), CONNECTION_OK) << PQerrorMessage(conn);
  PGresult* result = PQexec(conn, sql);
  EXPECT_EQ(PQresultStatus(result), PGRES_COMMAND_OK) << PQresultErrorMessage(result);
  PQclear(result);
  PQfinish(conn);
}

// The first column of the first row `sql` returns from a PostgreSQL database, read behind the
// store's back ("" for none).
inline std::string RawPostgresQuery(const std::string& url, const char* sql) {
  PGconn* conn = PQconnectdb(url.c_str());
  std::string value;
  EXPECT_EQ(PQstatus(conn), CONNECTION_OK) << PQerrorMessage(conn);
  PGresult* result = PQexec(conn, sql);
  EXPECT_EQ(PQresultStatus(result), PGRES_TUPLES_OK) << PQresultErrorMessage(result);
  if (PQresultStatus(result) == PGRES_TUPLES_OK && PQntuples(result) > 0) {
    value = PQgetvalue(result, 0, 0);
  }
  PQclear(result);
  PQfinish(conn);
  return value;
}

// The store's backends, for suites that run against both (StoreBackendTest).
enum class StoreBackend { kSqlite, kPostgres };

inline std::string StoreBackendName(const ::testing::TestParamInfo<StoreBackend>& info) {
  return info.param == StoreBackend::kSqlite ? "Sqlite" : "Postgres";
}

// A test of the Store run once per backend: location() is a fresh SQLite file, or a fresh
// database of the private PostgreSQL cluster (tests/postgres_fixture.h); the PostgreSQL run
// skips, saying why, when that cluster cannot start. Instantiate it in each binary with
// INSTANTIATE_TEST_SUITE_P(Backends, StoreBackendTest, kStoreBackends, StoreBackendName).
class StoreBackendTest : public ::testing::TestWithParam<StoreBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == StoreBackend::kSqlite) {
      location_ = dir_.path() + "/coordinator.db";
      return;
    }
    tessera::testing::PostgresCluster& cluster = tessera::testing::PostgresCluster::Shared();
    location_ = cluster.NewDatabase();
    if (location_.empty()) GTEST_SKIP() << "no PostgreSQL server: " << cluster.Reason();
  }

  // What Store::Open takes: a file path or a postgresql:// URL.
  const std::string& location() const { return location_; }
  bool postgres() const { return GetParam() == StoreBackend::kPostgres; }

  // The first column of the first row `sql` returns, read behind the store's back ("" for
  // none), on either backend.
  std::string QueryValue(const char* sql) {
    return postgres() ? RawPostgresQuery(location_, sql) : RawQuery(location_, sql);
  }

 private:
  tessera::testing::ScopedTempDir dir_{"store"};
  std::string location_;
};

inline const auto kStoreBackends =
    ::testing::Values(StoreBackend::kSqlite, StoreBackend::kPostgres);

}  // namespace tessera::coordinator
