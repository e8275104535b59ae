#include "trainer/runtime/loss_guard.h"

#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::testing::HasSubstr;

v1::GuardSpec Spec(double loss_factor, int window, double grad_factor = 0) {
  v1::GuardSpec spec;
  spec.set_loss_spike_factor(loss_factor);
  spec.set_window(window);
  spec.set_grad_norm_spike_factor(grad_factor);
  return spec;
}

TEST(LossGuardTest, JudgesAgainstTheMedianOnlyOnceTheWindowIsFull) {
  LossGuard guard(Spec(2.0, 4));
  // Three good steps: a 100x loss is not judged yet (the window is not full).
  for (double loss : {3.0, 2.0, 2.5}) {
    EXPECT_EQ(guard.Check(1, loss, 1.0), std::nullopt);
    guard.Accept(loss, 1.0);
  }
  EXPECT_EQ(guard.Check(4, 250.0, 1.0), std::nullopt);
  guard.Accept(2.2, 1.0);
  ASSERT_EQ(guard.size(), 4);
  // Median of {3, 2, 2.5, 2.2} is 2.35: 4.7 is the threshold.
  EXPECT_EQ(guard.Check(5, 4.69, 1.0), std::nullopt);
  std::optional<v1::LossSpike> spike = guard.Check(5, 4.71, 1.0);
  ASSERT_TRUE(spike.has_value());
  EXPECT_EQ(spike->step(), 5);
  EXPECT_DOUBLE_EQ(spike->loss(), 4.71);
  EXPECT_DOUBLE_EQ(spike->loss_median(), 2.35);
  EXPECT_THAT(spike->cause(), HasSubstr("loss 4.71 at step 5 > 2 x median 2.35"));
}

TEST(LossGuardTest, TheWindowSlidesAndTheMedianIgnoresAnOutlier) {
  LossGuard guard(Spec(3.0, 3));
  for (double loss : {10.0, 10.0, 10.0, 1.0, 1.0}) guard.Accept(loss, 1.0);
  // The window holds {10, 1, 1}: median 1, so 3.5 is a spike although the mean (4) would pass it.
  ASSERT_EQ(guard.size(), 3);
  std::optional<v1::LossSpike> spike = guard.Check(6, 3.5, 1.0);
  ASSERT_TRUE(spike.has_value());
  EXPECT_DOUBLE_EQ(spike->loss_median(), 1.0);
}

TEST(LossGuardTest, NanOrInfAlwaysSpikesEvenWithChecksOffAndAnEmptyWindow) {
  LossGuard guard(v1::GuardSpec{});
  EXPECT_EQ(guard.window(), kDefaultGuardWindow);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  std::optional<v1::LossSpike> by_loss = guard.Check(1, nan, 1.0);
  ASSERT_TRUE(by_loss.has_value());
  EXPECT_THAT(by_loss->cause(), HasSubstr("loss is nan at step 1"));
  std::optional<v1::LossSpike> by_norm = guard.Check(2, 2.0, inf);
  ASSERT_TRUE(by_norm.has_value());
  EXPECT_THAT(by_norm->cause(), HasSubstr("gradient norm is inf at step 2"));
  // Factor 0 turns the relative checks off: a huge finite loss passes.
  for (int i = 0; i < kDefaultGuardWindow; ++i) guard.Accept(1.0, 1.0);
  EXPECT_EQ(guard.Check(30, 1e9, 1e9), std::nullopt);
}

TEST(LossGuardTest, GradientNormSpikeAgainstItsOwnWindow) {
  LossGuard guard(Spec(/*loss_factor=*/0, 2, /*grad_factor=*/5));
  guard.Accept(2.0, 0.5);
  guard.Accept(2.0, 1.5);
  // Median norm 1.0: 5.0 passes, 5.1 is a spike; the loss never counts here (factor 0).
  EXPECT_EQ(guard.Check(3, 2000.0, 5.0), std::nullopt);
  std::optional<v1::LossSpike> spike = guard.Check(3, 2.0, 5.1);
  ASSERT_TRUE(spike.has_value());
  EXPECT_DOUBLE_EQ(spike->grad_norm_median(), 1.0);
  EXPECT_THAT(spike->cause(), HasSubstr("gradient norm 5.1 at step 3 > 5 x median 1"));
}

TEST(LossGuardTest, SkippedBatchesShiftTheBatchEachStepDraws) {
  v1::GuardSpec spec;
  v1::SkippedBatches* first = spec.add_skipped();
  first->set_step(5);
  first->set_batches(2);
  v1::SkippedBatches* again = spec.add_skipped();
  again->set_step(5);
  again->set_batches(1);
  v1::SkippedBatches* later = spec.add_skipped();
  later->set_step(9);
  later->set_batches(4);
  EXPECT_EQ(BatchesSkippedAt(spec, 4), 0);
  EXPECT_EQ(BatchesSkippedAt(spec, 5), 3);
  EXPECT_EQ(BatchesSkippedAt(spec, 9), 4);
  EXPECT_EQ(BatchIndexOfStep(spec, 4), 3);
  EXPECT_EQ(BatchIndexOfStep(spec, 5), 7);
  EXPECT_EQ(BatchIndexOfStep(spec, 8), 10);
  EXPECT_EQ(BatchIndexOfStep(spec, 9), 15);
}

}  // namespace
}  // namespace tessera::trainer
