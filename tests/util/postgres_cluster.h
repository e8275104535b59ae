// A private PostgreSQL server for the store's tests and the control-plane benchmark: initdb (once
// per user and binary directory, then copied for every cluster) into a temporary directory,
// pg_ctl start on a free loopback port with its unix socket in the same directory (nothing under
// /var/run is touched), a fresh database per caller, and pg_ctl stop when the owner is destroyed.
// initdb refuses to run as root (as CI does), so as root the server runs as `nobody`; as anyone
// else, as that user. The role is `tessera`; without a password every connection is trusted, with
// one TCP connections must give it (scram-sha-256) while the administrative commands use the
// socket.
//
// It needs the server's binaries (Debian's postgresql); callers skip or report, saying why, when
// Start fails. Not a production tool: a coordinator's database is the operator's.
//
// Thread safety: NewDatabase may be called from any thread; Restart and destruction from one.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessera {

// Where Debian's postgresql package puts the server's binaries.
inline constexpr char kDefaultPostgresBinDir[] = "/usr/lib/postgresql/15/bin";
// Overrides kDefaultPostgresBinDir for the tests and the benchmark (read by them, not here).
inline constexpr char kPostgresBinDirEnv[] = "TESSERA_PG_BIN";
// The role every cluster has.
inline constexpr char kPostgresClusterUser[] = "tessera";

struct PostgresClusterOptions {
  std::string bin_dir = kDefaultPostgresBinDir;
  // The cluster's directory (data, socket, log) is made under it.
  std::string parent_dir = "/tmp";
  // The role's password; empty: trust on loopback.
  std::string password;
  // false: fsync=off (the tests, which check what the store sends, not the disk). The store
  // checks synchronous_commit, which stays on either way.
  bool fsync = true;
  // More server settings, each "name=value" (passed as -c).
  std::vector<std::string> settings;
};

class PostgresCluster {
 public:
  // UNAVAILABLE (or NOT_FOUND for missing binaries), naming the log to read, when it does not
  // start. A watchdog stops the server and removes its directory once this process is gone, so
  // a process killed by a timeout leaves nothing running.
  static absl::StatusOr<std::unique_ptr<PostgresCluster>> Start(
      const PostgresClusterOptions& options);
  // Stops the server (immediate) and removes its directory.
  ~PostgresCluster();
  PostgresCluster(const PostgresCluster&) = delete;
  PostgresCluster& operator=(const PostgresCluster&) = delete;

  int port() const { return port_; }
  const std::string& dir() const { return dir_; }

  // A new empty database, "postgresql://tessera@127.0.0.1:<port>/<prefix>_<pid>_<n>" (no
  // password in it: give it by file or PGPASSWORD).
  absl::StatusOr<std::string> NewDatabase(const std::string& prefix);

  // pg_ctl restart -m fast, same port and settings: every connection is dropped and refused
  // until it is back.
  absl::Status Restart();

 private:
  PostgresCluster(std::string bin_dir, std::string dir, std::string as_user)
      : bin_(std::move(bin_dir)), dir_(std::move(dir)), as_user_(std::move(as_user)) {}

  absl::Status CopyTemplate();
  absl::Status RequirePassword(const std::string& password);
  std::string ServerOptions() const;
  std::string Tool(const std::string& name) const;

  std::string bin_;
  std::string dir_;
  // "runuser -u nobody -- " as root, else empty: the prefix of the server's commands.
  std::string as_user_;
  std::vector<std::string> settings_;
  int port_ = 0;
  bool running_ = false;
  std::atomic<int> next_database_{0};
};

}  // namespace tessera
