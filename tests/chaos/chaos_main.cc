// tessera-chaos-soak: the chaos soak of `make chaos` (tests/chaos/chaos_soak.h). Flags → options →
// run; prints the seed first (to replay a failure), a line per fault and per job end, then the
// counts as JSON (also written to --results). Exit 0 when nothing was lost, orphaned, corrupt or
// unequal; 1 when something was; 2 on bad flags; 77 (ctest's skip) when the machine cannot build
// the network (not root, no ip/iptables) or, with --require_ha, has no PostgreSQL.

#include <fstream>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "common/command_line.h"
#include "tests/chaos/chaos_soak.h"
#include "tests/util/subprocess.h"

ABSL_FLAG(absl::Duration, duration, absl::Minutes(15),
          "How long faults are injected; the drain and the checks follow.");
ABSL_FLAG(uint64_t, seed, 0, "Seed of every random choice; 0 picks one from the clock.");
ABSL_FLAG(std::string, results, "", "Write the counts as JSON to this file too.");
ABSL_FLAG(std::string, dir, "",
          "Directory for the soak's files; empty: a fresh one under /tmp, removed after a clean "
          "run.");
ABSL_FLAG(int, workers, 3, "Worker daemons, each on a network namespace of its own.");
ABSL_FLAG(bool, ha, true,
          "Two coordinators on a private PostgreSQL (when installed), and kill -9 of the leader "
          "among the faults.");
ABSL_FLAG(bool, require_ha, false,
          "With --ha: exit 77 (skip) instead of running on SQLite when PostgreSQL is absent.");
ABSL_FLAG(int, min_job_steps, 200, "Fewest steps a job trains.");
ABSL_FLAG(int, max_job_steps, 500, "Most steps a job trains.");
ABSL_FLAG(int, jobs_in_flight, 2, "Jobs kept submitted and unfinished at a time.");
ABSL_FLAG(double, fault_interval, 6, "Mean seconds between two faults.");
ABSL_FLAG(int, loss_checks, 3, "SUCCEEDED jobs rerun fault-free to compare their losses.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Minutes(6),
          "How long the jobs may take to end after the faults stop before they count as lost.");
ABSL_FLAG(std::string, corpus, TESSERA_CORPUS_FILE, "Text file the jobs train on.");

namespace {
constexpr char kUsage[] =
    "Usage: tessera-chaos-soak [--duration=15m] [--seed=N] [--results=FILE]\n"
    "Kills and partitions a cluster on network namespaces while jobs train (needs root).";
// ctest's SKIP_RETURN_CODE convention, as the Python integration tests use.
constexpr int kSkipExitCode = 77;
}  // namespace

int main(int argc, char** argv) {
  tessera::ParseCommandLine(argc, argv, kUsage);
  tessera::chaos::SoakOptions options;
  options.duration = absl::GetFlag(FLAGS_duration);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.dir = absl::GetFlag(FLAGS_dir);
  options.workers = absl::GetFlag(FLAGS_workers);
  options.ha = absl::GetFlag(FLAGS_ha);
  options.require_ha = absl::GetFlag(FLAGS_require_ha);
  options.min_job_steps = absl::GetFlag(FLAGS_min_job_steps);
  options.max_job_steps = absl::GetFlag(FLAGS_max_job_steps);
  if (options.min_job_steps < 1 || options.max_job_steps < options.min_job_steps) {
    std::cerr << "chaos soak: --min_job_steps must be at least 1 and at most --max_job_steps"
              << std::endl;
    return 2;
  }
  options.jobs_in_flight = absl::GetFlag(FLAGS_jobs_in_flight);
  options.mean_fault_interval_s = absl::GetFlag(FLAGS_fault_interval);
  options.loss_checks = absl::GetFlag(FLAGS_loss_checks);
  options.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  options.corpus = absl::GetFlag(FLAGS_corpus);
  options.bin_dir = tessera::testing::BinDir();

  absl::StatusOr<nlohmann::json> result = tessera::chaos::RunChaosSoak(options);
  if (!result.ok()) {
    std::cerr << "chaos soak: " << result.status() << std::endl;
    return absl::IsFailedPrecondition(result.status()) ? kSkipExitCode : 1;
  }
  const std::string text = result->dump(2);
  std::cout << text << std::endl;
  if (const std::string path = absl::GetFlag(FLAGS_results); !path.empty()) {
    std::ofstream(path) << text << "\n";
  }
  const bool passed = (*result)["passed"] == true;
  std::cout << "chaos soak: " << (passed ? "PASSED" : "FAILED") << " (seed " << (*result)["seed"]
            << ")" << std::endl;
  return passed ? 0 : 1;
}
