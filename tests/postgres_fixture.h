// The private PostgreSQL cluster of a test binary (tests/util/postgres_cluster.h): started on first
// use, one fresh database per test, stopped when the binary ends. Authentication is `trust` on
// loopback only, and fsync is off: the tests check what the store sends and when it returns
// (synchronous_commit, which the store checks, stays on); flushing every createdb and commit to a
// disk that other tests share made each test case seconds slower.
//
// When the binaries are missing or the server does not start, NewDatabase() is empty and Reason()
// says why: tests then GTEST_SKIP() with it, so a skip is reported, never a silent pass.
//
// Thread safety: Shared() starts the one cluster of the process on first use (a function-local
// static); NewDatabase may be called from any test thread.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "tests/util/postgres_cluster.h"

namespace tessera::testing {

class PostgresCluster {
 public:
  // The cluster of this test binary, started on first use.
  static PostgresCluster& Shared() {
    static PostgresCluster* cluster = new PostgresCluster();  // stopped by its atexit hook
    return *cluster;
  }

  bool ok() const { return cluster_ != nullptr; }
  const std::string& Reason() const { return reason_; }

  // Restarts the server (pg_ctl restart -m fast, same port and settings): every connection is
  // dropped and refused until it is back. For tests of reconnecting; false when it did not
  // come back.
  bool Restart() {
    if (!ok()) return false;
    const absl::Status restarted = cluster_->Restart();
    if (!restarted.ok()) reason_ = std::string(restarted.message());
    return restarted.ok();
  }

  // A database of its own for one test: "postgresql://tessera@127.0.0.1:<port>/<name>", or ""
  // (see Reason()) when the cluster is not running or createdb fails.
  std::string NewDatabase() {
    if (!ok()) return "";
    absl::StatusOr<std::string> url = cluster_->NewDatabase("test");
    if (!url.ok()) {
      reason_ = std::string(url.status().message());
      return "";
    }
    return *url;
  }

 private:
  PostgresCluster() {
    tessera::PostgresClusterOptions options;
    const char* bin = std::getenv(tessera::kPostgresBinDirEnv);
    if (bin != nullptr && *bin != '\0') options.bin_dir = bin;
    options.fsync = false;
    absl::StatusOr<std::unique_ptr<tessera::PostgresCluster>> started =
        tessera::PostgresCluster::Start(options);
    if (!started.ok()) {
      reason_ = std::string(started.status().message());
      return;
    }
    cluster_ = std::move(started).value();
    std::atexit(+[] { Shared().cluster_.reset(); });
  }

  std::unique_ptr<tessera::PostgresCluster> cluster_;
  std::string reason_;
};

}  // namespace tessera::testing
