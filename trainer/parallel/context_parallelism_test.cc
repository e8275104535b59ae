// Context parallelism's run-level rules and the data-side split: the refusals name the field at
// fault, and the split of a dp rank's token rows equals ring attention's split of the same tensor
// (so that a rank's tokens, targets and positions line up with its queries).
#include "trainer/parallel/context_parallelism.h"

#include <cstdint>
#include <vector>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

// The layout's splits are planner::CheckSplitRules' (LayoutRulesTest); the data is the trainer's
// to check.
TEST(ContextParallelSplitsTest, PackedRecordsAreRefusedNamingTheShards) {
  EXPECT_THAT(CheckContextParallelData(/*packed_records=*/true, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("data.train_shards")));
  EXPECT_THAT(CheckContextParallelData(/*packed_records=*/true, 1), IsOk());
  EXPECT_THAT(CheckContextParallelData(/*packed_records=*/false, 4), IsOk());
}

TEST(ShardRowsForContextParallelTest, EqualsRingAttentionsSplitOfTheSameRows) {
  const int64_t batch = 3, seq = 16;
  std::vector<int64_t> rows(batch * seq);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int64_t>(i * 7 + 1);
  const torch::Tensor full = torch::tensor(rows).view({batch, seq});
  for (int cp : {1, 2, 4}) {
    std::vector<torch::Tensor> parts;
    for (int rank = 0; rank < cp; ++rank) {
      const std::vector<int64_t> mine = ShardRowsForContextParallel(
          rows, seq, ContextParallel{.group = nullptr, .rank = rank, .size = cp});
      ASSERT_EQ(mine.size(), rows.size() / cp);
      const torch::Tensor local = torch::tensor(mine).view({batch, seq / cp});
      EXPECT_TRUE(torch::equal(local, ShardForContextParallel(full, rank, cp)))
          << "cp " << cp << " rank " << rank;
      parts.push_back(local);
    }
    EXPECT_TRUE(torch::equal(GatherFromContextParallel(parts), full)) << "cp " << cp;
  }
  // Rank 1 of cp 2 holds chunks 1 and 2 of 4: tokens 4..11 of each row.
  const std::vector<int64_t> mine = ShardRowsForContextParallel(
      rows, seq, ContextParallel{.group = nullptr, .rank = 1, .size = 2});
  EXPECT_EQ(mine.front(), rows[4]);
  EXPECT_EQ(mine[7], rows[11]);
  EXPECT_EQ(mine[8], rows[seq + 4]);
}

TEST(ShardRowsForContextParallelTest, RefusesRowsThatDoNotSplit) {
  const std::vector<int64_t> rows(30, 1);
  EXPECT_THROW(ShardRowsForContextParallel(rows, 15,
                                           ContextParallel{.group = nullptr, .rank = 0, .size = 2}),
               c10::Error);
}

}  // namespace
}  // namespace tessera::trainer
