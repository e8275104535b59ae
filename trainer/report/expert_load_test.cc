#include "trainer/report/expert_load.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::testing::ElementsAre;

TEST(ExpertLoadTest, EachLayersSlotsAndItsBusiestExpertOverTheMean) {
  // Layer 0: 8 slots split evenly over 4 experts; layer 1: all on expert 2; layer 2: 6, 1, 1, 0
  // (mean 2, busiest 6); layer 3: nothing routed.
  const std::vector<v1::ExpertLoad> loads =
      ExpertLoads({2, 2, 2, 2, 0, 0, 8, 0, 6, 1, 1, 0, 0, 0, 0, 0}, /*layers=*/4, /*experts=*/4);
  ASSERT_EQ(loads.size(), 4u);
  EXPECT_EQ(loads[0].layer(), 0);
  EXPECT_THAT(loads[0].tokens(), ElementsAre(2, 2, 2, 2));
  EXPECT_DOUBLE_EQ(loads[0].imbalance(), 1.0);
  EXPECT_EQ(loads[1].layer(), 1);
  EXPECT_THAT(loads[1].tokens(), ElementsAre(0, 0, 8, 0));
  EXPECT_DOUBLE_EQ(loads[1].imbalance(), 4.0);
  EXPECT_DOUBLE_EQ(loads[2].imbalance(), 3.0);
  EXPECT_DOUBLE_EQ(loads[3].imbalance(), 0.0);
}

TEST(ExpertLoadTest, CountsOfTheWrongSizeGiveNothing) {
  EXPECT_TRUE(ExpertLoads({1, 2, 3}, 2, 2).empty());
  EXPECT_TRUE(ExpertLoads({}, 0, 4).empty());
}

}  // namespace
}  // namespace tessera::trainer
