// Every job spec in examples/ parses, passes the coordinator's validation and is a layout the
// trainer runs, so the documentation never shows a spec that would be refused; and an explicit
// layout for a named GPU fits it by the planner's estimate.

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "client/job_spec_file.h"
#include "common/status_matchers.h"
#include "coordinator/admission/job_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/hf_config.h"
#include "planner/job_plan.h"
#include "planner/model_config.h"
#include "tests/util/temp_dir.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;

// A Hugging Face model directory holding only the config.json of `preset` (what validation and
// planning read of a from_pretrained model).
std::string ConfigOnlyModel(const std::string& root, const std::string& preset) {
  v1::ModelSpec spec;
  spec.set_preset(preset);
  auto summary = planner::ResolveModel(spec, 1);
  EXPECT_THAT(summary, IsOk());
  auto config = planner::HfConfigJson(summary->dims(), "");
  EXPECT_THAT(config, IsOk());
  const std::string dir = root + "/" + preset;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << *config;
  return dir;
}

TEST(ExamplesTest, EverySpecParsesAndValidates) {
  int count = 0;
  int planned = 0;
  testing::ScopedTempDir models("examples_test");
  const std::string llama3_8b = ConfigOnlyModel(models.path(), "llama3-8b");
  const std::string tiny_llama = ConfigOnlyModel(models.path(), "tiny-llama");
  for (const auto& entry : std::filesystem::directory_iterator(TESSERA_EXAMPLES_DIR)) {
    if (entry.path().extension() != ".yaml") continue;
    ++count;
    // The examples read their data and model directories from the environment.
    auto spec = client::LoadJobSpec(
        entry.path().string(), [&](const std::string& name) -> std::optional<std::string> {
          if (name == "TESSERA_DATA_DIR") return "/data/tessera";
          if (name == "LLAMA3_8B_DIR") return llama3_8b;
          if (name == "TESSERA_BASE_MODEL") return tiny_llama;
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
  EXPECT_GE(count, 6);
  EXPECT_GE(planned, 4);
}

}  // namespace
}  // namespace tessera
