// Which backends the control-plane benchmark runs and how it compares them: --backends is
// checked (an unknown name is refused naming the flag), the default takes PostgreSQL only when
// its binaries are there and otherwise says why not, and the comparison pairs runs of the same
// size and scenario across backends and takes medians of each.
#include "bench/control_plane_backends.h"

#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "bench/control_plane_queues.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BackendChoiceTest, DefaultTakesPostgresOnlyWhenItsBinariesAreThere) {
  tessera::testing::ScopedTempDir dir("backends");
  absl::StatusOr<BackendChoice> without = ChooseBackends({}, dir.path());
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_THAT(without->backends, ElementsAre(kSqliteBackend));
  EXPECT_THAT(without->skipped,
              HasSubstr("postgresql skipped: no PostgreSQL server binaries in " + dir.path()));

  const std::string initdb = dir.path() + "/initdb";
  std::ofstream(initdb) << "#!/bin/sh\n";
  ASSERT_EQ(chmod(initdb.c_str(), 0755), 0);
  absl::StatusOr<BackendChoice> with = ChooseBackends({}, dir.path());
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_THAT(with->backends, ElementsAre(kSqliteBackend, kPostgresBackend));
  EXPECT_EQ(with->skipped, "");
}

TEST(BackendChoiceTest, NamesAreCheckedAndKeptInOrderOnce) {
  absl::StatusOr<BackendChoice> chosen =
      ChooseBackends({"postgresql", "sqlite", "postgresql"}, "/nonexistent");
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  EXPECT_THAT(chosen->backends, ElementsAre(kPostgresBackend, kSqliteBackend));
  absl::StatusOr<BackendChoice> unknown = ChooseBackends({"mysql"}, "/nonexistent");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unknown.status().message(), HasSubstr("--backends: unknown backend 'mysql'"));
}

ScaleResult MakeRun(const char* backend, const char* scenario, int nodes, double p99_seconds,
                    double placed) {
  ScaleResult result;
  result.backend = backend;
  result.scenario = scenario;
  result.nodes = nodes;
  result.heartbeat.p99 = p99_seconds;
  result.jobs_placed_per_second = placed;
  return result;
}

TEST(BackendComparisonTest, PairsRunsOfOneSizeAndScenarioAndTakesMedians) {
  const std::vector<ScaleResult> results = {
      MakeRun(kSqliteBackend, kSinglePoolScenario, 100, 0.010, 20),
      MakeRun(kPostgresBackend, kSinglePoolScenario, 100, 0.040, 18),
      MakeRun(kSqliteBackend, kSinglePoolScenario, 100, 0.030, 19),
      MakeRun(kPostgresBackend, kSinglePoolScenario, 100, 0.020, 16),
      MakeRun(kSqliteBackend, kSinglePoolScenario, 100, 0.020, 21),
      MakeRun(kPostgresBackend, kSinglePoolScenario, 100, 0.060, 17),
      // Another scenario at the same size is compared on its own.
      MakeRun(kSqliteBackend, kQueuesScenario, 100, 0.100, 10),
      MakeRun(kPostgresBackend, kQueuesScenario, 100, 0.100, 5),
      // A size run on one backend only is not compared.
      MakeRun(kSqliteBackend, kSinglePoolScenario, 200, 0.010, 1)};
  const std::vector<BackendComparison> comparisons = CompareBackends(results);
  ASSERT_EQ(comparisons.size(), 2u);
  EXPECT_EQ(comparisons[0].nodes, 100);
  EXPECT_EQ(comparisons[0].scenario, kSinglePoolScenario);
  EXPECT_EQ(comparisons[0].sqlite.runs, 3);
  EXPECT_EQ(comparisons[0].postgresql.runs, 3);
  EXPECT_DOUBLE_EQ(comparisons[0].sqlite.heartbeat_p99_seconds, 0.020);
  EXPECT_DOUBLE_EQ(comparisons[0].postgresql.heartbeat_p99_seconds, 0.040);
  EXPECT_DOUBLE_EQ(comparisons[0].sqlite.placed_per_second, 20);
  EXPECT_DOUBLE_EQ(comparisons[0].postgresql.placed_per_second, 17);
  EXPECT_EQ(comparisons[1].scenario, kQueuesScenario);
  EXPECT_DOUBLE_EQ(comparisons[1].postgresql.placed_per_second, 5);
  const std::string text = FormatBackendComparisons(comparisons);
  // heartbeat p99 40 / 20 ms, placements 17 / 20.
  EXPECT_THAT(text, HasSubstr("2.00x"));
  EXPECT_THAT(text, HasSubstr("0.85x"));
  EXPECT_THAT(text, HasSubstr("0.50x"));
}

}  // namespace
}  // namespace tessera::bench
