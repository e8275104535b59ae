#include "planner/lr_schedule.h"

#include <cmath>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::planner {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

v1::LearningRateSchedule Schedule(double peak, int64_t warmup, double min_ratio,
                                  int64_t decay_steps = 0) {
  v1::LearningRateSchedule schedule;
  schedule.set_peak_learning_rate(peak);
  schedule.set_warmup_steps(warmup);
  schedule.set_min_lr_ratio(min_ratio);
  schedule.set_decay_steps(decay_steps);
  return schedule;
}

TEST(LrScheduleTest, WarmupIsLinearFromZeroToPeak) {
  auto schedule = Schedule(1e-3, 10, 0.1);
  EXPECT_DOUBLE_EQ(LearningRateAt(schedule, 100, 1), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(schedule, 100, 5), 5e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(schedule, 100, 10), 1e-3);
}

TEST(LrScheduleTest, CosineDecaysToTheFloorAndStaysThere) {
  auto schedule = Schedule(1e-3, 10, 0.1);
  // Half-way through the decay the cosine term is 0.5.
  EXPECT_NEAR(LearningRateAt(schedule, 110, 60), 1e-4 + 0.9e-3 * 0.5, 1e-15);
  EXPECT_NEAR(LearningRateAt(schedule, 110, 110), 1e-4, 1e-15);
  EXPECT_NEAR(LearningRateAt(schedule, 110, 500), 1e-4, 1e-15);
  double previous = LearningRateAt(schedule, 110, 10);
  for (int64_t step = 11; step <= 110; ++step) {
    double lr = LearningRateAt(schedule, 110, step);
    EXPECT_LE(lr, previous) << "step " << step;
    previous = lr;
  }
}

TEST(LrScheduleTest, DecayStepsOverridesMaxSteps) {
  auto pinned = Schedule(1.0, 0, 0.0, 200);
  EXPECT_NEAR(LearningRateAt(pinned, 100, 100), 0.5, 1e-12);
  EXPECT_NEAR(LearningRateAt(pinned, 200, 100), 0.5, 1e-12);
}

TEST(LrScheduleTest, ValidationNamesTheField) {
  EXPECT_THAT(ValidateSchedule(Schedule(1e-3, 10, 0.1), 100), IsOk());
  EXPECT_THAT(ValidateSchedule(Schedule(0, 10, 0.1), 100),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("peak_learning_rate")));
  EXPECT_THAT(ValidateSchedule(Schedule(1e-3, 10, 1.5), 100),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("min_lr_ratio")));
  EXPECT_THAT(ValidateSchedule(Schedule(1e-3, -1, 0.1), 100),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("warmup_steps")));
  EXPECT_THAT(ValidateSchedule(Schedule(1e-3, 1, 0.1), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_steps")));
}

}  // namespace
}  // namespace tessera::planner
