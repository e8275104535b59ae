// StepTimer against a clock: phases measured where the loop marks them, other what they leave of
// the wall time, the step's collectives (and only the step's) by kind and dimension.
#include "trainer/runtime/step_timer.h"

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using Clock = std::chrono::steady_clock;

void SleepMillis(int millis) { std::this_thread::sleep_for(std::chrono::milliseconds(millis)); }

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(StepTimerTest, PhasesAndOtherAddUpToTheWallTime) {
  StepTimer timer(/*enabled=*/true);
  // A collective before the step belongs to no step.
  RecordCollective(IssueCollective(CollectiveKind::kBroadcast, nullptr, 8, false));
  const Clock::time_point start = Clock::now();
  timer.StartStep();
  {
    StepTimer::Scope data(timer, StepPhase::kDataWait);
    SleepMillis(5);
  }
  {
    StepTimer::Scope forward(timer, StepPhase::kForward);
    SleepMillis(30);
  }
  {
    StepTimer::Scope backward(timer, StepPhase::kBackward);
    const CollectiveIssue issue = IssueCollective(CollectiveKind::kAllReduce, nullptr, 256, false);
    SleepMillis(15);
    RecordCollective(issue);
  }
  SleepMillis(10);  // unmarked: other
  {
    StepTimer::Scope optimizer(timer, StepPhase::kOptimizer);
    SleepMillis(5);
  }
  const double wall = SecondsSince(start);
  const v1::StepTimeBreakdown b = timer.FinishStep(wall, /*checkpoint_blocked_seconds=*/0.002);
  EXPECT_GE(b.data_wait_seconds(), 0.005);
  EXPECT_GE(b.forward_seconds(), 0.030);
  EXPECT_GE(b.backward_seconds(), 0.015);
  EXPECT_GE(b.optimizer_seconds(), 0.005);
  EXPECT_DOUBLE_EQ(b.checkpoint_blocked_seconds(), 0.002);
  // Sleeps overshoot a little; the unmarked 10 ms is other's, less the 2 ms of checkpoint.
  EXPECT_GE(b.other_seconds(), 0.007);
  const double sum = b.forward_seconds() + b.backward_seconds() + b.optimizer_seconds() +
                     b.data_wait_seconds() + b.checkpoint_blocked_seconds() + b.other_seconds();
  EXPECT_NEAR(sum, wall, 1e-9);
  ASSERT_EQ(b.collectives_size(), 1) << b.ShortDebugString();
  EXPECT_EQ(b.collectives(0).kind(), "all_reduce");
  EXPECT_EQ(b.collectives(0).dim(), "world");
  EXPECT_EQ(b.collectives(0).calls(), 1);
  EXPECT_EQ(b.collectives(0).bytes(), 256);
  EXPECT_GE(b.collectives(0).seconds(), 0.015);
  EXPECT_LE(b.collectives(0).seconds(), b.backward_seconds());

  // The next step starts from zero.
  timer.StartStep();
  const v1::StepTimeBreakdown next = timer.FinishStep(0.001, 0);
  EXPECT_EQ(next.forward_seconds(), 0);
  EXPECT_EQ(next.collectives_size(), 0);
  EXPECT_DOUBLE_EQ(next.other_seconds(), 0.001);
}

// What the timer adds per collective and per phase mark (docs/performance.md turns it into a
// share of a step). Loose bounds: a loaded machine slows it, never by 100x.
TEST(StepTimerTest, CostsLittlePerCollectiveAndPhase) {
  constexpr int kCalls = 100000;
  StepTimer timer(/*enabled=*/true);
  timer.StartStep();
  Clock::time_point start = Clock::now();
  for (int i = 0; i < kCalls; ++i) {
    RecordCollective(IssueCollective(CollectiveKind::kAllReduce, nullptr, 8, false));
  }
  const double per_collective = SecondsSince(start) / kCalls;
  start = Clock::now();
  for (int i = 0; i < kCalls; ++i) StepTimer::Scope scope(timer, StepPhase::kForward);
  const double per_scope = SecondsSince(start) / kCalls;
  std::cout << "per collective " << per_collective * 1e9 << " ns, per phase mark "
            << per_scope * 1e9 << " ns\n";
  RecordProperty("ns_per_collective", std::to_string(per_collective * 1e9));
  RecordProperty("ns_per_phase_mark", std::to_string(per_scope * 1e9));
  EXPECT_LT(per_collective, 20e-6);
  EXPECT_LT(per_scope, 20e-6);
  const v1::StepTimeBreakdown b = timer.FinishStep(1.0, 0);
  ASSERT_EQ(b.collectives_size(), 1);
  EXPECT_EQ(b.collectives(0).calls(), kCalls);
}

TEST(StepTimerTest, DisabledMeasuresNothing) {
  StepTimer timer(/*enabled=*/false);
  EXPECT_FALSE(CollectiveTimingEnabled());
  timer.StartStep();
  {
    StepTimer::Scope forward(timer, StepPhase::kForward);
    SleepMillis(2);
  }
  RecordCollective(IssueCollective(CollectiveKind::kAllReduce, nullptr, 256, false));
  const v1::StepTimeBreakdown b = timer.FinishStep(0.01, 0);
  EXPECT_EQ(b.ByteSizeLong(), 0u) << b.ShortDebugString();
  SetCollectiveTimingEnabled(true);
}

}  // namespace
}  // namespace tessera::trainer
