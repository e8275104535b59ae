#include "bench/control_plane_backends.h"

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/errno_status.h"
#include "common/status_macros.h"

namespace tessera::bench {
namespace {

// 24 random hex digits: the password of the run's private server.
std::string RandomPassword() {
  std::random_device device;
  std::string password;
  for (int i = 0; i < 3; ++i) absl::StrAppendFormat(&password, "%08x", device());
  return password;
}

BackendComparison::Side Summarize(const std::vector<const ScaleResult*>& runs) {
  BackendComparison::Side side;
  side.runs = static_cast<int>(runs.size());
  auto median = [&runs](const std::function<double(const ScaleResult&)>& of) {
    std::vector<double> values;
    for (const ScaleResult* run : runs) values.push_back(of(*run));
    return SpreadOf(values).median;
  };
  side.heartbeat_p50_seconds = median([](const ScaleResult& r) { return r.heartbeat.p50; });
  side.heartbeat_p99_seconds = median([](const ScaleResult& r) { return r.heartbeat.p99; });
  side.placed_per_second = median([](const ScaleResult& r) { return r.jobs_placed_per_second; });
  side.scheduling_p50_seconds = median([](const ScaleResult& r) { return r.scheduling.p50; });
  side.scheduling_p99_seconds = median([](const ScaleResult& r) { return r.scheduling.p99; });
  side.submit_p99_seconds = median([](const ScaleResult& r) { return r.submit.p99; });
  side.register_seconds = median([](const ScaleResult& r) { return r.register_seconds; });
  side.store_writes_per_second =
      median([](const ScaleResult& r) { return r.internals.store_writes_per_second; });
  side.store_write_mean_seconds =
      median([](const ScaleResult& r) { return r.internals.mean_store_write_seconds; });
  side.store_writer_cores =
      median([](const ScaleResult& r) { return r.internals.store_writer_cores; });
  side.coordinator_cores = median([](const ScaleResult& r) { return r.coordinator_cores; });
  return side;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

}  // namespace

absl::StatusOr<BackendChoice> ChooseBackends(const std::vector<std::string>& requested,
                                             const std::string& bin_dir) {
  BackendChoice choice;
  if (requested.empty()) {
    choice.backends.push_back(kSqliteBackend);
    if (access((bin_dir + "/initdb").c_str(), X_OK) == 0) {
      choice.backends.push_back(kPostgresBackend);
    } else {
      choice.skipped =
          absl::StrCat(kPostgresBackend, " skipped: no PostgreSQL server binaries in ", bin_dir,
                       " (install Debian's postgresql, or set ", kPostgresBinDirEnv, ")");
    }
    return choice;
  }
  for (const std::string& name : requested) {
    if (name != kSqliteBackend && name != kPostgresBackend) {
      return absl::InvalidArgumentError(absl::StrCat("--backends: unknown backend '", name, "' (",
                                                     kSqliteBackend, " or ", kPostgresBackend,
                                                     ")"));
    }
    if (std::find(choice.backends.begin(), choice.backends.end(), name) == choice.backends.end()) {
      choice.backends.push_back(name);
    }
  }
  return choice;
}

absl::StatusOr<std::unique_ptr<PostgresBackend>> PostgresBackend::Start(
    const std::string& bin_dir, const std::string& work_dir) {
  PostgresClusterOptions options;
  options.bin_dir = bin_dir;
  options.parent_dir = work_dir;
  options.password = RandomPassword();
  // Connections: one coordinator at a time, with its writer, readers and leader session.
  ASSIGN_OR_RETURN(std::unique_ptr<PostgresCluster> cluster, PostgresCluster::Start(options));
  std::unique_ptr<PostgresBackend> backend(new PostgresBackend(std::move(cluster)));
  // The coordinator reads the password from a file (--database_password_file), as
  // docs/coordinator.md asks: never on its command line.
  backend->password_file_ = absl::StrCat(backend->cluster_->dir(), "/password");
  {
    std::ofstream out(backend->password_file_, std::ios::trunc);
    out << options.password << "\n";
    out.close();
    if (!out) return ErrnoToStatus(errno, backend->password_file_);
  }
  if (chmod(backend->password_file_.c_str(), 0600) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("chmod ", backend->password_file_));
  }
  return backend;
}

absl::Status PostgresBackend::Prepare(ScaleOptions& options) {
  ASSIGN_OR_RETURN(options.state_url,
                   cluster_->NewDatabase(absl::StrCat("bench_", options.fleet.nodes)));
  options.database_password_file = password_file_;
  return absl::OkStatus();
}

std::vector<BackendComparison> CompareBackends(const std::vector<ScaleResult>& results) {
  using Key = std::pair<int, std::string>;
  std::vector<Key> order;
  std::map<Key, std::map<std::string, std::vector<const ScaleResult*>>> runs;
  for (const ScaleResult& result : results) {
    const Key key{result.nodes, result.scenario};
    if (!runs.contains(key)) order.push_back(key);
    runs[key][result.backend].push_back(&result);
  }
  std::vector<BackendComparison> comparisons;
  for (const Key& key : order) {
    auto& by_backend = runs[key];
    if (!by_backend.contains(kSqliteBackend) || !by_backend.contains(kPostgresBackend)) continue;
    BackendComparison& comparison = comparisons.emplace_back();
    comparison.nodes = key.first;
    comparison.scenario = key.second;
    comparison.sqlite = Summarize(by_backend[kSqliteBackend]);
    comparison.postgresql = Summarize(by_backend[kPostgresBackend]);
  }
  return comparisons;
}

std::string FormatBackendComparisons(const std::vector<BackendComparison>& comparisons) {
  std::string out;
  for (const BackendComparison& c : comparisons) {
    absl::StrAppendFormat(&out,
                          "\n%d nodes, %s: the store on PostgreSQL against SQLite (medians of "
                          "%d / %d runs, same fleet and jobs):\n",
                          c.nodes, c.scenario, c.postgresql.runs, c.sqlite.runs);
    absl::StrAppendFormat(&out, "  %-30s %12s %12s %10s\n", "", "sqlite", "postgresql",
                          "pg/sqlite");
    auto row = [&out](const char* name, double sqlite, double postgresql, int digits) {
      absl::StrAppendFormat(&out, "  %-30s %12.*f %12.*f %9.2fx\n", name, digits, sqlite, digits,
                            postgresql, Ratio(postgresql, sqlite));
    };
    const BackendComparison::Side& s = c.sqlite;
    const BackendComparison::Side& p = c.postgresql;
    row("heartbeat p50 (ms)", s.heartbeat_p50_seconds * 1e3, p.heartbeat_p50_seconds * 1e3, 2);
    row("heartbeat p99 (ms)", s.heartbeat_p99_seconds * 1e3, p.heartbeat_p99_seconds * 1e3, 2);
    row("jobs placed/s", s.placed_per_second, p.placed_per_second, 1);
    row("sched p50 (ms)", s.scheduling_p50_seconds * 1e3, p.scheduling_p50_seconds * 1e3, 0);
    row("sched p99 (ms)", s.scheduling_p99_seconds * 1e3, p.scheduling_p99_seconds * 1e3, 0);
    row("SubmitJob p99 (ms)", s.submit_p99_seconds * 1e3, p.submit_p99_seconds * 1e3, 1);
    row("fleet registered in (s)", s.register_seconds, p.register_seconds, 1);
    row("store writes/s", s.store_writes_per_second, p.store_writes_per_second, 1);
    row("store write, mean (ms)", s.store_write_mean_seconds * 1e3,
        p.store_write_mean_seconds * 1e3, 2);
    row("store writer cores", s.store_writer_cores, p.store_writer_cores, 2);
    row("coordinator cores", s.coordinator_cores, p.coordinator_cores, 2);
  }
  return out;
}

}  // namespace tessera::bench
