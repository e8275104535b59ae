// Every job spec in examples/ parses, passes the coordinator's validation and is a layout the
// trainer runs, so the documentation never shows a spec that would be refused; and an explicit
// layout for a named GPU fits it by the planner's estimate.

#include <filesystem>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "client/job_spec_file.h"
#include "common/status_matchers.h"
#include "coordinator/job_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/job_plan.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;

TEST(ExamplesTest, EverySpecParsesAndValidates) {
  int count = 0;
  int planned = 0;
  for (const auto& entry : std::filesystem::directory_iterator(TESSERA_EXAMPLES_DIR)) {
    if (entry.path().extension() != ".yaml") continue;
    ++count;
    // The CPU example reads its data directory from the environment.
    auto spec = client::LoadJobSpec(
        entry.path().string(), [](const std::string& name) -> std::optional<std::string> {
          if (name == "TESSERA_DATA_DIR") return "/data/tessera";
          return std::nullopt;
        });
    ASSERT_THAT(spec, IsOk()) << entry.path();
    EXPECT_THAT(coordinator::ValidateJobSpec(*spec), IsOk()) << entry.path();
    EXPECT_THAT(coordinator::ValidateTrainerRuns(*spec), IsOk()) << entry.path();
    EXPECT_THAT(coordinator::PlanJob(*spec), IsOk()) << entry.path();
    if (!spec->parallelism().has_layout() || spec->resources().gpu_type().empty()) continue;
    // What `tessera plan SPEC --device=<gpu_type>` estimates, 8 GPUs per node.
    v1::PlanLayoutRequest request;
    *request.mutable_spec() = *spec;
    request.set_gpu_type(spec->resources().gpu_type());
    auto plan = planner::PlanLayoutRequest(request, absl::UnavailableError("offline"));
    ASSERT_THAT(plan, IsOk()) << entry.path();
    EXPECT_TRUE(plan->plan().fits()) << entry.path() << ": " << plan->plan().explanation();
    ++planned;
  }
  EXPECT_GE(count, 4);
  EXPECT_GE(planned, 3);
}

}  // namespace
}  // namespace tessera
