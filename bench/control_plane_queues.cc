#include "bench/control_plane_queues.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessera::bench {
namespace {

// Demand weights cycle through 1..kDemandSteps within a cohort.
constexpr int kDemandSteps = 5;

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// The cohort of queue `index`, and its position in it.
std::pair<int, int> CohortOf(const QueueScenarioOptions& options, int index) {
  const int cohorts = std::clamp(options.cohorts, 1, std::max(1, options.queues));
  const int per_cohort = options.queues / cohorts;
  const int first_extra = options.queues % cohorts;
  // The first cohort takes the remainder.
  const int first_size = per_cohort + first_extra;
  if (index < first_size) return {0, index};
  return {1 + (index - first_size) / per_cohort, (index - first_size) % per_cohort};
}

ScenarioComparison::Side Summarize(const std::vector<const ScaleResult*>& runs) {
  ScenarioComparison::Side side;
  side.runs = static_cast<int>(runs.size());
  std::vector<double> pass, placed, pending, cores;
  for (const ScaleResult* run : runs) {
    pass.push_back(run->internals.mean_pass_seconds);
    placed.push_back(run->jobs_placed_per_second);
    pending.push_back(run->occupancy.mean_pending_jobs);
    cores.push_back(run->coordinator_cores);
  }
  side.pass_seconds = Median(pass);
  side.placed_per_second = Median(placed);
  side.pending_jobs = Median(pending);
  side.coordinator_cores = Median(cores);
  return side;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

}  // namespace

std::vector<std::string> QueueNames(const QueueScenarioOptions& options) {
  std::vector<std::string> names;
  for (int i = 0; i < options.queues; ++i) names.push_back(absl::StrFormat("q-%02d", i));
  return names;
}

std::vector<double> QueueDemandWeights(const QueueScenarioOptions& options) {
  std::vector<double> weights;
  for (int i = 0; i < options.queues; ++i) {
    weights.push_back(1 + CohortOf(options, i).second % kDemandSteps);
  }
  return weights;
}

std::string QueueFileYaml(const QueueScenarioOptions& options, int64_t fleet_gpus) {
  const std::vector<std::string> names = QueueNames(options);
  const int queues = static_cast<int>(names.size());
  std::string yaml = "cohorts:\n";
  int cohorts = 0;
  for (int i = 0; i < queues; ++i) cohorts = std::max(cohorts, CohortOf(options, i).first + 1);
  for (int c = 0; c < cohorts; ++c) absl::StrAppendFormat(&yaml, "  - name: cohort-%d\n", c);
  absl::StrAppend(&yaml, "queues:\n");
  for (int i = 0; i < queues; ++i) {
    // Nominal quotas sum to the fleet: the remainder goes to the first queues, a GPU each.
    const int64_t nominal = fleet_gpus / queues + (i < fleet_gpus % queues ? 1 : 0);
    const auto [cohort, position] = CohortOf(options, i);
    absl::StrAppendFormat(&yaml, "  - name: %s\n    cohort: cohort-%d\n    nominal: {gpus: %d}\n",
                          names[i], cohort, nominal);
    // Every other queue may borrow at most half its nominal quota; the others, all the cohort
    // does not use.
    if (position % 2 == 1) {
      absl::StrAppendFormat(&yaml, "    borrowing_limit: {gpus: %d}\n", nominal / 2);
    }
  }
  if (!names.empty()) absl::StrAppend(&yaml, "default_queue: ", names.front(), "\n");
  return yaml;
}

std::vector<ScenarioComparison> CompareScenarios(const std::vector<ScaleResult>& results) {
  using Key = std::pair<int, std::string>;  // nodes, backend
  std::vector<Key> order;
  std::map<Key, std::map<std::string, std::vector<const ScaleResult*>>> by_nodes;
  for (const ScaleResult& result : results) {
    const Key key{result.nodes, result.backend};
    if (!by_nodes.contains(key)) order.push_back(key);
    by_nodes[key][result.scenario].push_back(&result);
  }
  std::vector<ScenarioComparison> comparisons;
  for (const Key& key : order) {
    auto& scenarios = by_nodes[key];
    if (!scenarios.contains(kSinglePoolScenario) || !scenarios.contains(kQueuesScenario)) continue;
    ScenarioComparison& comparison = comparisons.emplace_back();
    comparison.nodes = key.first;
    comparison.backend = key.second;
    comparison.single_pool = Summarize(scenarios[kSinglePoolScenario]);
    comparison.queues = Summarize(scenarios[kQueuesScenario]);
  }
  return comparisons;
}

std::string FormatComparisons(const std::vector<ScenarioComparison>& comparisons) {
  std::string out;
  for (const ScenarioComparison& c : comparisons) {
    absl::StrAppendFormat(
        &out,
        "\n%d nodes, queues against the single pool (medians of %d / %d runs, same fleet and "
        "jobs%s):\n",
        c.nodes, c.queues.runs, c.single_pool.runs,
        c.backend.empty() || c.backend == "sqlite" ? "" : absl::StrCat(", on ", c.backend));
    absl::StrAppendFormat(&out, "  %-28s %12s %12s %8s\n", "", "single-pool", "queues", "ratio");
    auto row = [&out](const char* name, double single, double queues, int digits) {
      absl::StrAppendFormat(&out, "  %-28s %12.*f %12.*f %7.2fx\n", name, digits, single, digits,
                            queues, Ratio(queues, single));
    };
    row("scheduler pass, mean (ms)", c.single_pool.pass_seconds * 1e3, c.queues.pass_seconds * 1e3,
        1);
    row("jobs placed/s", c.single_pool.placed_per_second, c.queues.placed_per_second, 1);
    row("pending jobs (mean)", c.single_pool.pending_jobs, c.queues.pending_jobs, 0);
    row("coordinator cores", c.single_pool.coordinator_cores, c.queues.coordinator_cores, 2);
  }
  return out;
}

}  // namespace tessera::bench
