// Every job spec in examples/ parses and passes the coordinator's validation,
// so the documentation never shows a spec that would be refused.

#include <filesystem>

#include "client/job_spec_file.h"
#include "common/status_matchers.h"
#include "coordinator/job_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;

TEST(ExamplesTest, EverySpecParsesAndValidates) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(TESSERA_EXAMPLES_DIR)) {
    if (entry.path().extension() != ".yaml") continue;
    ++count;
    auto spec = client::LoadJobSpec(entry.path().string());
    ASSERT_THAT(spec, IsOk()) << entry.path();
    EXPECT_THAT(coordinator::ValidateJobSpec(*spec), IsOk()) << entry.path();
    EXPECT_THAT(coordinator::PlanJob(*spec), IsOk()) << entry.path();
  }
  EXPECT_GE(count, 3);
}

}  // namespace
}  // namespace tessera
