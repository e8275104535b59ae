// control_plane_bench: the control plane at scale. For each fleet size it
// starts the real tessera-coordinator, joins that many simulated 8-GPU
// worker nodes heartbeating over the real NodeService protocol, feeds it a
// steady stream of mixed-size jobs, and measures heartbeat latency against a
// no-op gRPC health check on the same connections, submission-to-placement
// latency, placements per second, and the coordinator's CPU and memory.
// With --queues, each fleet size is also run with that many queues and quotas
// (control_plane_queues.h), alternated with the single pool --repeats times,
// and the medians of both are compared.
// Prints a table and writes $TESSERA_BENCH_RESULTS/control-plane.json.
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_env.h"
#include "bench/control_plane_backends.h"
#include "bench/control_plane_queues.h"
#include "bench/control_plane_report.h"
#include "bench/control_plane_scale.h"
#include "common/command_line.h"
#include "common/version.h"

// The build directory; its bin/ holds tessera-coordinator.
constexpr char kBuildDirEnv[] = "TESSERA_BUILD_DIR";
// Where temporary files go when --work_dir is not given.
constexpr char kTmpDirEnv[] = "TMPDIR";
constexpr char kResultsFile[] = "control-plane.json";

ABSL_FLAG(std::string, coordinator, "",
          "Path of tessera-coordinator; default $TESSERA_BUILD_DIR/bin/tessera-coordinator, "
          "else ../bin/tessera-coordinator beside this binary.");
ABSL_FLAG(std::vector<std::string>, nodes, std::vector<std::string>({"100", "1000", "10000"}),
          "Fleet sizes to run, one fresh coordinator each, e.g. 100,1000,10000.");
ABSL_FLAG(std::vector<std::string>, jobs_per_s, std::vector<std::string>({"5", "20", "20"}),
          "Jobs submitted per second for each --nodes entry in turn; entries past the end of "
          "this list use its last value.");
ABSL_FLAG(double, duration_s, 20, "Measured seconds per fleet size.");
ABSL_FLAG(double, warmup_s, 5, "Seconds of job flow after the fleet joined, before measuring.");
ABSL_FLAG(int, windows, 4,
          "The measured window is cut into this many equal parts; ranges are over them.");
ABSL_FLAG(int, channels, 8, "gRPC connections the simulated nodes are spread over.");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(1), "Heartbeat period of each node.");
ABSL_FLAG(int, gpus_per_node, 8, "Simulated GPUs per node (NVIDIA H100 80GB HBM3).");
ABSL_FLAG(double, health_checks_per_s, 20,
          "grpc.health.v1.Health/Check calls per second, the no-op baseline; 0 disables.");
ABSL_FLAG(std::vector<std::string>, job_gpus, std::vector<std::string>({"1", "8", "16", "64"}),
          "GPUs per job in the mix (data-parallel layouts of that world size).");
ABSL_FLAG(std::vector<std::string>, job_weights, std::vector<std::string>({"4", "3", "2", "1"}),
          "Relative frequency of each --job_gpus size.");
ABSL_FLAG(absl::Duration, min_run_time, absl::Seconds(2), "Shortest simulated job run.");
ABSL_FLAG(absl::Duration, max_run_time, absl::Seconds(5), "Longest simulated job run.");
ABSL_FLAG(int, metric_steps, 10,
          "Step metrics rank 0 reports (NodeService/Report) before its job finishes; 0 none.");
ABSL_FLAG(bool, watch_assignments, false,
          "Each simulated node keeps a NodeService.WatchAssignments stream open and heartbeats "
          "when notified, as workers do by default; false (the default, comparable with the "
          "figures in most tables of docs/performance.md): orders wait for the next heartbeat. "
          "The streams cost the coordinator memory and, under overload, placements (see there).");
ABSL_FLAG(bool, announce_ends, true,
          "Each simulated node heartbeats at once when a task ends, as workers do (after rank "
          "0's last report); false: the end waits for the node's next heartbeat slot, as in the "
          "figures before 2026-11-28 (devices then stay held up to two periods past the run).");
ABSL_FLAG(int, max_backlog, 2000,
          "Submissions pause while this many submitted jobs still wait for their ranks.");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(15),
          "The coordinator's --heartbeat_timeout.");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(120),
          "How long a fleet may take to register before measuring anyway.");
ABSL_FLAG(int, queues, 0,
          "With N > 0, each fleet size is also run as the queues scenario: the same fleet and "
          "jobs, the coordinator given N queues (nominal GPU quotas summing to the fleet, in "
          "--queue_cohorts cohorts, every other queue with a borrowing limit) and each job "
          "submitted to one of them; the summary compares it with the single pool.");
ABSL_FLAG(int, queue_cohorts, 10, "Cohorts the --queues are dealt into.");
ABSL_FLAG(int, repeats, 1,
          "Runs of each scenario at each fleet size, alternated (single pool, then queues); the "
          "comparison reports medians.");
ABSL_FLAG(std::vector<std::string>, backends, {},
          "The coordinator's store in each run: sqlite, postgresql, or both (alternated, each "
          "run against a fresh database of a private PostgreSQL server started for this "
          "benchmark), compared side by side. Default: both when the PostgreSQL server binaries "
          "are found ($TESSERA_PG_BIN, else /usr/lib/postgresql/15/bin), else sqlite alone.");
ABSL_FLAG(std::string, work_dir, "",
          "Where each coordinator's state directory is made; default $TMPDIR, else /tmp.");
ABSL_FLAG(bool, keep_state, false,
          "Keep each coordinator's SQLite file and log (a PostgreSQL server is removed anyway).");
ABSL_FLAG(std::string, results_dir, "",
          "Directory for control-plane.json; default $TESSERA_BENCH_RESULTS, else the current "
          "directory.");

constexpr char kUsage[] =
    "Usage: control_plane_bench [--coordinator=PATH] [--nodes=100,1000,10000] "
    "[--duration_s=20]\n\n"
    "Runs tessera-coordinator against simulated fleets of 8-GPU nodes heartbeating over the\n"
    "real NodeService protocol while jobs are submitted, and reports heartbeat latency\n"
    "(against a no-op health check), submit-to-placement latency, placements per second\n"
    "and the coordinator's CPU and memory. Writes control-plane.json.\n";

namespace tessera::bench {
namespace {

template <typename T>
absl::StatusOr<std::vector<T>> ParseList(const std::string& flag,
                                         const std::vector<std::string>& items) {
  std::vector<T> values;
  for (const std::string& item : items) {
    T value;
    bool ok;
    if constexpr (std::is_same_v<T, int>) {
      ok = absl::SimpleAtoi(item, &value) && value > 0;
    } else {
      ok = absl::SimpleAtod(item, &value) && value > 0;
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", item, "' is not a positive number"));
    }
    values.push_back(value);
  }
  if (values.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": empty"));
  return values;
}

// "/tmp (ext4)": fsync on tmpfs is free, on a real disk it is not.
std::string DescribeFilesystem(const std::string& path) {
  struct statfs info {};
  if (statfs(path.c_str(), &info) != 0) return absl::StrCat(path, " (unknown filesystem)");
  const char* type;
  switch (static_cast<unsigned long>(info.f_type)) {
    case 0xEF53:
      type = "ext4";
      break;
    case 0x01021994:
      type = "tmpfs";
      break;
    case 0x794C7630:
      type = "overlayfs";
      break;
    case 0x58465342:
      type = "xfs";
      break;
    case 0x9123683E:
      type = "btrfs";
      break;
    default:
      return absl::StrFormat("%s (filesystem type 0x%x)", path,
                             static_cast<unsigned long>(info.f_type));
  }
  return absl::StrCat(path, " (", type, ")");
}

std::string DefaultCoordinator() {
  const std::string build_dir = EnvOr(kBuildDirEnv, "");
  if (!build_dir.empty()) return build_dir + "/bin/tessera-coordinator";
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return "tessera-coordinator";
  return (self.parent_path().parent_path() / "bin" / "tessera-coordinator").string();
}

int Run() {
  auto nodes = ParseList<int>("nodes", absl::GetFlag(FLAGS_nodes));
  auto rates = ParseList<double>("jobs_per_s", absl::GetFlag(FLAGS_jobs_per_s));
  auto job_gpus = ParseList<int>("job_gpus", absl::GetFlag(FLAGS_job_gpus));
  auto job_weights = ParseList<double>("job_weights", absl::GetFlag(FLAGS_job_weights));
  for (const absl::Status& status :
       {nodes.status(), rates.status(), job_gpus.status(), job_weights.status()}) {
    if (!status.ok()) {
      std::cerr << "control_plane_bench: " << status.message() << "\n";
      return 2;
    }
  }
  if (job_weights->size() != job_gpus->size()) {
    std::cerr << "control_plane_bench: --job_weights needs one weight per --job_gpus size\n";
    return 2;
  }

  ScaleOptions base;
  base.coordinator_binary = absl::GetFlag(FLAGS_coordinator);
  if (base.coordinator_binary.empty()) base.coordinator_binary = DefaultCoordinator();
  base.work_dir = absl::GetFlag(FLAGS_work_dir);
  if (base.work_dir.empty()) base.work_dir = EnvOr(kTmpDirEnv, "/tmp");
  base.keep_state = absl::GetFlag(FLAGS_keep_state);
  base.coordinator_heartbeat_timeout = absl::GetFlag(FLAGS_heartbeat_timeout);
  base.register_timeout = absl::GetFlag(FLAGS_register_timeout);
  base.warmup = absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  base.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  base.windows = std::max(1, absl::GetFlag(FLAGS_windows));
  base.fleet.channels = std::max(1, absl::GetFlag(FLAGS_channels));
  base.fleet.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  base.fleet.gpus_per_node = absl::GetFlag(FLAGS_gpus_per_node);
  base.fleet.health_checks_per_second = absl::GetFlag(FLAGS_health_checks_per_s);
  base.fleet.min_run_time = absl::GetFlag(FLAGS_min_run_time);
  base.fleet.max_run_time = std::max(base.fleet.min_run_time, absl::GetFlag(FLAGS_max_run_time));
  base.fleet.metric_steps_per_job = absl::GetFlag(FLAGS_metric_steps);
  base.fleet.watch_assignments = absl::GetFlag(FLAGS_watch_assignments);
  base.fleet.announce_ends = absl::GetFlag(FLAGS_announce_ends);
  base.jobs.gpu_sizes = *job_gpus;
  base.jobs.weights = *job_weights;
  base.jobs.max_backlog = absl::GetFlag(FLAGS_max_backlog);

  RunInfo info;
  const Provenance provenance = ReadProvenance();
  info.commit = provenance.commit;
  info.date = provenance.date;
  info.machine = provenance.machine;
  info.state_filesystem = DescribeFilesystem(base.work_dir);
  std::string results_dir = absl::GetFlag(FLAGS_results_dir);
  if (results_dir.empty()) results_dir = ResultsDir(".");

  const QueueScenarioOptions queue_scenario{
      .queues = std::max(0, absl::GetFlag(FLAGS_queues)),
      .cohorts = std::max(1, absl::GetFlag(FLAGS_queue_cohorts))};
  std::vector<const char*> scenarios = {kSinglePoolScenario};
  if (queue_scenario.queues > 0) scenarios.push_back(kQueuesScenario);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));

  auto backends = ChooseBackends(absl::GetFlag(FLAGS_backends),
                                 EnvOr(kPostgresBinDirEnv, kDefaultPostgresBinDir));
  if (!backends.ok()) {
    std::cerr << "control_plane_bench: " << backends.status().message() << "\n";
    return 2;
  }
  if (!backends->skipped.empty()) std::cout << "control_plane_bench: " << backends->skipped << "\n";
  std::unique_ptr<PostgresBackend> postgres;
  if (std::find(backends->backends.begin(), backends->backends.end(), kPostgresBackend) !=
      backends->backends.end()) {
    auto started =
        PostgresBackend::Start(EnvOr(kPostgresBinDirEnv, kDefaultPostgresBinDir), base.work_dir);
    if (!started.ok()) {
      std::cerr << "control_plane_bench: starting PostgreSQL: " << started.status() << std::endl;
      return 1;
    }
    postgres = std::move(started).value();
  }

  std::vector<ScaleResult> results;
  int failures = 0;
  for (size_t i = 0; i < nodes->size(); ++i) {
    for (int repeat = 0; repeat < repeats; ++repeat) {
      for (const char* scenario : scenarios) {
        for (const std::string& backend : backends->backends) {
          ScaleOptions options = base;
          options.scenario = scenario;
          options.backend = backend;
          if (backend == kPostgresBackend) {
            if (absl::Status prepared = postgres->Prepare(options); !prepared.ok()) {
              std::cerr << "control_plane_bench: " << prepared << std::endl;
              ++failures;
              continue;
            }
          }
          options.fleet.nodes = (*nodes)[i];
          options.jobs.jobs_per_second = (*rates)[std::min(i, rates->size() - 1)];
          if (options.scenario == kQueuesScenario) {
            options.queue_file_yaml = QueueFileYaml(
                queue_scenario, int64_t{options.fleet.nodes} * options.fleet.gpus_per_node);
            options.jobs.queues = QueueNames(queue_scenario);
            options.jobs.queue_weights = QueueDemandWeights(queue_scenario);
          }
          std::cerr << "control_plane_bench: " << options.fleet.nodes << " nodes, " << scenario
                    << " on " << backend << ", run " << repeat + 1 << " of " << repeats << ", "
                    << options.jobs.jobs_per_second << " jobs/s offered..." << std::endl;
          auto result = RunScale(options);
          if (!result.ok()) {
            std::cerr << "control_plane_bench: " << options.fleet.nodes << " nodes, " << scenario
                      << " on " << backend << ": " << result.status() << std::endl;
            ++failures;
            continue;
          }
          results.push_back(std::move(*result));
        }
      }
    }
  }

  std::cout << FormatSummary(info, base, results) << FormatComparisons(CompareScenarios(results))
            << FormatBackendComparisons(CompareBackends(results)) << std::flush;
  std::error_code error;
  std::filesystem::create_directories(results_dir, error);
  const std::string path = absl::StrCat(results_dir, "/", kResultsFile);
  if (absl::Status written = WriteJson(path, info, base, results); !written.ok()) {
    std::cerr << "control_plane_bench: " << written << std::endl;
    return 1;
  }
  std::cout << "\nwrote " << path << std::endl;
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  tessera::ParseCommandLine(argc, argv, kUsage);
  // As in the coordinator: Debian's Abseil looks for lock-order cycles on every acquisition,
  // ~5% of the load generator's CPU at 500 jobs/s, taken from the coordinator it measures.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return tessera::bench::Run();
}
