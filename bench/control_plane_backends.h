// The coordinator's store on SQLite and on PostgreSQL in one run of the control-plane benchmark:
// which backends to run (--backends), a private PostgreSQL server for the run
// (tests/util/postgres_cluster.h, a fresh database per coordinator, the password in a file as
// docs/coordinator.md asks of operators), and the two side by side, medians over the repeats,
// with PostgreSQL / SQLite ratios.
//
// Thread safety: PostgresBackend from one thread; the rest are plain values and pure functions.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/control_plane_scale.h"
#include "tests/util/postgres_cluster.h"

namespace tessera::bench {

// ScaleOptions::backend / ScaleResult::backend of each.
inline constexpr char kSqliteBackend[] = "sqlite";
inline constexpr char kPostgresBackend[] = "postgresql";

// What --backends asked for. Empty: SQLite, and PostgreSQL when its binaries are in `bin_dir`
// (`skipped` then says why not). INVALID_ARGUMENT naming --backends for an unknown name.
struct BackendChoice {
  std::vector<std::string> backends;
  // "postgresql skipped: <why>" when the default left PostgreSQL out; else empty.
  std::string skipped;
};
absl::StatusOr<BackendChoice> ChooseBackends(const std::vector<std::string>& requested,
                                             const std::string& bin_dir);

// A PostgreSQL server for the run: durable as a production one (fsync and synchronous_commit
// on, default settings otherwise), its data under `work_dir` beside the SQLite runs' files,
// password authentication on loopback.
class PostgresBackend {
 public:
  static absl::StatusOr<std::unique_ptr<PostgresBackend>> Start(const std::string& bin_dir,
                                                                const std::string& work_dir);
  // A fresh database for one coordinator; `options` gets its URL and the password file.
  absl::Status Prepare(ScaleOptions& options);

 private:
  explicit PostgresBackend(std::unique_ptr<PostgresCluster> cluster)
      : cluster_(std::move(cluster)) {}

  std::unique_ptr<PostgresCluster> cluster_;
  std::string password_file_;
};

// One fleet size and scenario, both backends: medians over their runs.
struct BackendComparison {
  int nodes = 0;
  std::string scenario;
  struct Side {
    int runs = 0;
    double heartbeat_p50_seconds = 0;
    double heartbeat_p99_seconds = 0;
    double placed_per_second = 0;
    double scheduling_p50_seconds = 0;
    double scheduling_p99_seconds = 0;
    double submit_p99_seconds = 0;
    double register_seconds = 0;
    // The coordinator's store: write transactions per second, their mean, its writer's CPU.
    double store_writes_per_second = 0;
    double store_write_mean_seconds = 0;
    double store_writer_cores = 0;
    double coordinator_cores = 0;
  };
  Side sqlite;
  Side postgresql;
};

// One comparison per (fleet size, scenario) with runs on both backends, in order of first
// appearance.
std::vector<BackendComparison> CompareBackends(const std::vector<ScaleResult>& results);
// The comparisons as text for the summary, PostgreSQL / SQLite ratios last.
std::string FormatBackendComparisons(const std::vector<BackendComparison>& comparisons);

}  // namespace tessera::bench
