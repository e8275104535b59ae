// StepTimeBreakdown's sums, means and log summary, and the heartbeat's mean of the steps since
// the previous heartbeat.
#include "trainer/report/step_breakdown.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "trainer/report/heartbeat.h"

namespace tessera::trainer {
namespace {

v1::StepTimeBreakdown Step(double forward, double backward, double other, double dp_seconds,
                           int64_t dp_bytes) {
  v1::StepTimeBreakdown b;
  b.set_forward_seconds(forward);
  b.set_backward_seconds(backward);
  b.set_optimizer_seconds(0.1);
  b.set_data_wait_seconds(0.05);
  b.set_other_seconds(other);
  v1::CollectiveTime* c = b.add_collectives();
  c->set_kind("all_reduce");
  c->set_dim("dp");
  c->set_seconds(dp_seconds);
  c->set_calls(3);
  c->set_bytes(dp_bytes);
  return b;
}

TEST(StepBreakdownTest, MeanOfStepsAddsPhasesAndCollectivesByKindAndDim) {
  v1::StepTimeBreakdown sum;
  AddBreakdown(Step(1.0, 2.0, 0.5, 0.2, 1000), &sum);
  v1::StepTimeBreakdown second = Step(3.0, 4.0, 1.5, 0.4, 3000);
  v1::CollectiveTime* tp = second.add_collectives();
  tp->set_kind("all_gather");
  tp->set_dim("tp");
  tp->set_seconds(0.8);
  tp->set_calls(2);
  tp->set_bytes(10);
  AddBreakdown(second, &sum);
  const v1::StepTimeBreakdown mean = MeanBreakdown(sum, 2);
  EXPECT_DOUBLE_EQ(mean.forward_seconds(), 2.0);
  EXPECT_DOUBLE_EQ(mean.backward_seconds(), 3.0);
  EXPECT_DOUBLE_EQ(mean.optimizer_seconds(), 0.1);
  EXPECT_DOUBLE_EQ(mean.other_seconds(), 1.0);
  ASSERT_EQ(mean.collectives_size(), 2);
  // Largest first: all_gather/tp's 0.4 s a step over all_reduce/dp's 0.3 s.
  EXPECT_EQ(mean.collectives(0).kind(), "all_gather");
  EXPECT_DOUBLE_EQ(mean.collectives(0).seconds(), 0.4);
  EXPECT_EQ(mean.collectives(0).calls(), 1);
  EXPECT_EQ(mean.collectives(1).dim(), "dp");
  EXPECT_DOUBLE_EQ(mean.collectives(1).seconds(), 0.3);
  EXPECT_EQ(mean.collectives(1).calls(), 3);
  EXPECT_EQ(mean.collectives(1).bytes(), 2000);
  EXPECT_EQ(MeanBreakdown(sum, 0).ByteSizeLong(), 0u);
}

TEST(StepBreakdownTest, SummaryGivesEachPhaseAndCollectiveShareOfTheStep) {
  const v1::StepTimeBreakdown b = Step(0.41, 0.38, 0.06, 0.12, 1);
  EXPECT_EQ(BreakdownSummary(b, 1.0),
            "fwd 41% bwd 38% opt 10% data 5% ckpt 0% other 6% | all_reduce/dp 12%");
  EXPECT_EQ(BreakdownSummary(b, 0), "");
}

TEST(StepBreakdownTest, HeartbeatCarriesTheMeanBreakdownOfItsInterval) {
  RankProgress progress;
  const v1::StepTimeBreakdown first = Step(1.0, 2.0, 0.5, 0.2, 1000);
  const v1::StepTimeBreakdown second = Step(3.0, 4.0, 1.5, 0.4, 3000);
  progress.StepFinished(1, 3.65, 3.0, &first);
  progress.StepFinished(2, 8.65, 8.0, &second);
  const v1::RankHeartbeat heartbeat = progress.TakeHeartbeat();
  EXPECT_DOUBLE_EQ(heartbeat.breakdown().forward_seconds(), 2.0);
  ASSERT_EQ(heartbeat.breakdown().collectives_size(), 1);
  EXPECT_DOUBLE_EQ(heartbeat.breakdown().collectives(0).seconds(), 0.3);
  // The next interval starts empty; a step without a breakdown leaves none.
  progress.StepFinished(3, 1.0, 1.0);
  EXPECT_FALSE(progress.TakeHeartbeat().has_breakdown());
}

}  // namespace
}  // namespace tessera::trainer
