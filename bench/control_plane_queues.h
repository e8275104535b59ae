// The queues scenario of the control-plane benchmark: the same fleet and the same job
// stream as the single-pool scenario, but the coordinator reads a queue file (--queue_file) of
// `queues` queues in cohorts, whose nominal GPU quotas sum to the fleet, and every job names one
// of them. Every other queue of a cohort has a borrowing limit; demand is spread unevenly over
// the queues of a cohort (weights 1..5), so some borrow and some are held by their quota.
// Also the comparison of the two scenarios of one run: medians over the repeats, and their ratio.
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/control_plane_scale.h"

namespace tessera::bench {

// ScaleResult::scenario of each.
inline constexpr char kSinglePoolScenario[] = "single-pool";
inline constexpr char kQueuesScenario[] = "queues";

struct QueueScenarioOptions {
  int queues = 50;
  // Queues are dealt into cohorts in order (queues / cohorts each, the remainder to the first).
  int cohorts = 10;
};

// Queue names, q-00, q-01, ..., in file order.
std::vector<std::string> QueueNames(const QueueScenarioOptions& options);
// Relative share of the jobs each queue gets: 1..5 in turn within a cohort.
std::vector<double> QueueDemandWeights(const QueueScenarioOptions& options);
// The queue file for a fleet of `fleet_gpus` GPUs.
std::string QueueFileYaml(const QueueScenarioOptions& options, int64_t fleet_gpus);

// The two scenarios at one fleet size, medians over their runs.
struct ScenarioComparison {
  int nodes = 0;
  // The store's backend both ran on (ScaleResult::backend).
  std::string backend;
  struct Side {
    int runs = 0;
    // The coordinator's mean scheduler pass (ScaleResult::internals), jobs placed per second
    // (client-side), pending jobs (the coordinator's gauge, mean over the window).
    double pass_seconds = 0;
    double placed_per_second = 0;
    double pending_jobs = 0;
    double coordinator_cores = 0;
  };
  Side single_pool;
  Side queues;
};

// One comparison per fleet size and backend that has runs of both scenarios, in order of first
// appearance.
std::vector<ScenarioComparison> CompareScenarios(const std::vector<ScaleResult>& results);
// The comparison as text for the summary.
std::string FormatComparisons(const std::vector<ScenarioComparison>& comparisons);

}  // namespace tessera::bench
