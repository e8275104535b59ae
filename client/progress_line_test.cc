#include "client/progress_line.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::StepMetrics Step(int64_t step, double seconds, double tokens_per_second) {
  v1::StepMetrics m;
  m.set_step(step);
  m.set_loss(5.0 - 0.01 * static_cast<double>(step));
  m.set_step_time_seconds(seconds);
  m.set_tokens_per_second(tokens_per_second);
  m.set_learning_rate(3e-3);
  m.set_mfu(0.42);
  return m;
}

TEST(ProgressLineTest, RateAndEtaAreAveragedOverTheWindow) {
  ProgressLine line(100);
  // Alternating fast and slow steps, as two ranks fighting over cores produce: 1024 tokens each.
  for (int step = 1; step <= 20; ++step) {
    const double seconds = step % 2 == 0 ? 0.01 : 0.5;
    line.Add(Step(step, seconds, 1024 / seconds));
  }
  EXPECT_NEAR(line.WindowTokensPerSecond(), 20 * 1024 / (10 * 0.01 + 10 * 0.5), 1e-6);
  EXPECT_NEAR(line.WindowSecondsPerStep(), 0.255, 1e-9);
  // 80 steps left at 0.255 s: 20.4 s.
  EXPECT_THAT(line.Render(200), HasSubstr("ETA 20s"));
  EXPECT_THAT(line.Render(200), HasSubstr("4.0k tok/s"));
  // Only the last kProgressWindow steps count.
  for (int step = 21; step <= 40; ++step) line.Add(Step(step, 1.0, 1000));
  EXPECT_NEAR(line.WindowSecondsPerStep(), 1.0, 1e-9);
  EXPECT_NEAR(line.WindowTokensPerSecond(), 1000, 1e-6);
}

TEST(ProgressLineTest, FitsTheWidthDroppingTheChartFirst) {
  ProgressLine line(1000);
  for (int step = 1; step <= 50; ++step) line.Add(Step(step, 0.1, 5000));
  const std::string wide = line.Render(500);
  EXPECT_THAT(wide, HasSubstr("\u2581"));  // the chart
  EXPECT_THAT(wide, HasSubstr("MFU 42.0%"));
  EXPECT_THAT(wide, HasSubstr("lr 3.00e-03"));
  for (int columns : {200, 120, 100, 80, 77, 60, 40, 20}) {
    const std::string fitted = line.Render(columns);
    EXPECT_LE(DisplayWidth(fitted), columns) << columns << ": " << fitted;
    EXPECT_THAT(fitted, Not(HasSubstr("\n")));
  }
  // At 77 columns (an 80-column terminal less the indent and margin) the step, loss and ETA stay,
  // and the chart is the first thing gone.
  const std::string at77 = line.Render(77);
  EXPECT_THAT(at77, HasSubstr("step 50/1000"));
  EXPECT_THAT(at77, HasSubstr("loss 4.5000"));
  EXPECT_THAT(at77, HasSubstr("ETA"));
  EXPECT_THAT(at77, Not(HasSubstr("\u2581")));
  EXPECT_THAT(line.Render(500, /*chart=*/false), Not(HasSubstr("\u2581")));
}

TEST(ProgressLineTest, NothingBeforeTheFirstStepAndANanLossIsShown) {
  ProgressLine line(10);
  EXPECT_EQ(line.Render(80), "");
  v1::StepMetrics diverged = Step(3, 0.1, 100);
  diverged.set_loss(std::numeric_limits<double>::quiet_NaN());
  line.Add(Step(2, 0.1, 100));
  line.Add(diverged);
  EXPECT_THAT(line.Render(200), HasSubstr("loss nan"));
  EXPECT_EQ(Sparkline({1.0, std::nan("")}), "\u2581\u2588");
}

TEST(ProgressLineTest, DisplayWidthCountsCodePoints) {
  EXPECT_EQ(DisplayWidth("abc"), 3);
  EXPECT_EQ(DisplayWidth("\u2581\u2588x"), 3);
}

}  // namespace
}  // namespace tessera::client
