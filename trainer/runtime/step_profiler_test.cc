// StepProfiler: --profile_steps parsing, and that a trace holds exactly the profiled steps.
#include "trainer/runtime/step_profiler.h"

#include <ATen/record_function.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/torch_pch.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(StepProfilerTest, ParsesFirstAndCount) {
  StepProfileOptions options;
  ASSERT_TRUE(ParseProfileSteps("6:3", &options).ok());
  EXPECT_EQ(options.first_step, 6);
  EXPECT_EQ(options.steps, 3);
  for (const char* bad : {"", "6", "0:3", "6:0", "a:b", "6:3:1", "-1:2"}) {
    const absl::Status status = ParseProfileSteps(bad, &options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(status.message()), HasSubstr("FIRST:COUNT")) << bad;
  }
}

TEST(StepProfilerTest, RecordsOnlyTheProfiledSteps) {
  const std::filesystem::path dir =
      std::filesystem::path(testing::TempDir()) / "step-profiler-test";
  std::filesystem::remove_all(dir);
  StepProfiler profiler({.directory = dir.string(), .first_step = 3, .steps = 2}, /*rank=*/1,
                        /*cuda=*/false);
  torch::Tensor x = torch::randn({64, 64});
  for (int64_t step = 1; step <= 6; ++step) {
    profiler.BeforeStep(step);
    {
      RECORD_USER_SCOPE("train_step");
      x = torch::tanh(x.mm(x));
    }
    ASSERT_TRUE(profiler.AfterStep(step, step == 6).ok());
    EXPECT_EQ(profiler.written().empty(), step < 4) << "step " << step;
  }
  const std::filesystem::path trace = dir / "trace-rank-1.json";
  EXPECT_EQ(profiler.written(), trace.string());
  std::ifstream in(trace);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(Count(text.str(), "\"name\": \"train_step\""), 2) << text.str().substr(0, 2000);
  EXPECT_GE(Count(text.str(), "aten::mm"), 2);
}

TEST(StepProfilerTest, ARunShorterThanTheRangeWritesWhatItRecorded) {
  const std::filesystem::path dir =
      std::filesystem::path(testing::TempDir()) / "step-profiler-short";
  std::filesystem::remove_all(dir);
  StepProfiler profiler({.directory = dir.string(), .first_step = 2, .steps = 10}, 0, false);
  for (int64_t step = 1; step <= 3; ++step) {
    profiler.BeforeStep(step);
    {
      RECORD_USER_SCOPE("train_step");
      EXPECT_EQ(torch::ones({8}).sum().item<float>(), 8.0f);
    }
    ASSERT_TRUE(profiler.AfterStep(step, step == 3).ok());
  }
  ASSERT_FALSE(profiler.written().empty());
  std::ifstream in(profiler.written());
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_EQ(Count(text.str(), "\"name\": \"train_step\""), 2);
}

}  // namespace
}  // namespace tessera::trainer
