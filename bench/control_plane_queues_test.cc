// The queues scenario's file and comparison: the file must be one the coordinator accepts, with
// the shape the benchmark claims (quotas summing to the fleet, cohorts, borrowing limits), and the
// comparison must take medians per scenario and size.
#include "bench/control_plane_queues.h"

#include <map>
#include <set>

#include "coordinator/queues/queue_config.h"
#include "gtest/gtest.h"

namespace tessera::bench {
namespace {

TEST(QueueScenarioTest, TheFileIsValidAndItsQuotasSumToTheFleet) {
  for (const auto& [queues, cohorts, gpus] :
       std::vector<std::tuple<int, int, int64_t>>{{50, 10, 80000}, {50, 10, 1603}, {7, 3, 56}}) {
    const QueueScenarioOptions options{.queues = queues, .cohorts = cohorts};
    auto config = coordinator::ParseQueueConfig(QueueFileYaml(options, gpus));
    ASSERT_TRUE(config.ok()) << config.status();
    ASSERT_EQ(config->queues.size(), static_cast<size_t>(queues));
    EXPECT_EQ(config->cohorts.size(), static_cast<size_t>(cohorts));
    EXPECT_EQ(config->default_queue, "q-00");
    int64_t nominal = 0;
    int limited = 0;
    std::map<std::string, int> per_cohort;
    for (const coordinator::QueueSpec& queue : config->queues) {
      nominal += queue.nominal.gpus;
      ++per_cohort[queue.cohort];
      if (queue.borrowing_limit_gpus.has_value()) {
        ++limited;
        EXPECT_EQ(*queue.borrowing_limit_gpus, queue.nominal.gpus / 2) << queue.name;
      }
    }
    EXPECT_EQ(nominal, gpus);
    EXPECT_EQ(per_cohort.size(), static_cast<size_t>(cohorts));
    EXPECT_GT(limited, 0);
    EXPECT_LT(limited, queues);
    EXPECT_EQ(QueueNames(options).size(), static_cast<size_t>(queues));
    const std::vector<double> weights = QueueDemandWeights(options);
    // 1..5 within a cohort; the first, largest, cohort also takes the remainder.
    EXPECT_EQ(std::set<double>(weights.begin(), weights.end()).size(),
              std::min<size_t>(5, queues / cohorts + queues % cohorts));
  }
}

ScaleResult MakeRun(const char* scenario, int nodes, double pass_seconds, double placed) {
  ScaleResult result;
  result.scenario = scenario;
  result.nodes = nodes;
  result.internals.mean_pass_seconds = pass_seconds;
  result.jobs_placed_per_second = placed;
  return result;
}

TEST(QueueScenarioTest, TheComparisonTakesMediansPerSizeAndScenario) {
  const std::vector<ScaleResult> results = {
      MakeRun(kSinglePoolScenario, 100, 0.010, 50), MakeRun(kQueuesScenario, 100, 0.030, 40),
      MakeRun(kSinglePoolScenario, 100, 0.020, 70), MakeRun(kQueuesScenario, 100, 0.010, 45),
      MakeRun(kSinglePoolScenario, 100, 0.090, 60), MakeRun(kQueuesScenario, 100, 0.020, 10),
      // A size with one scenario only is not compared.
      MakeRun(kSinglePoolScenario, 200, 0.010, 1)};
  const std::vector<ScenarioComparison> comparisons = CompareScenarios(results);
  ASSERT_EQ(comparisons.size(), 1u);
  EXPECT_EQ(comparisons[0].nodes, 100);
  EXPECT_EQ(comparisons[0].single_pool.runs, 3);
  EXPECT_DOUBLE_EQ(comparisons[0].single_pool.pass_seconds, 0.020);
  EXPECT_DOUBLE_EQ(comparisons[0].single_pool.placed_per_second, 60);
  EXPECT_DOUBLE_EQ(comparisons[0].queues.pass_seconds, 0.020);
  EXPECT_DOUBLE_EQ(comparisons[0].queues.placed_per_second, 40);
  EXPECT_NE(FormatComparisons(comparisons).find("0.67x"), std::string::npos)
      << FormatComparisons(comparisons);
}

}  // namespace
}  // namespace tessera::bench
