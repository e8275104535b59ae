#include "trainer/io/tensor_box.h"

#include <cstdint>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::trainer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// (first coordinates, length) of every run.
std::vector<std::pair<std::vector<int64_t>, int64_t>> Runs(const std::vector<int64_t>& shape,
                                                           const TensorBox& box) {
  std::vector<std::pair<std::vector<int64_t>, int64_t>> runs;
  ForEachRun(shape, box, [&](const std::vector<int64_t>& first, int64_t length) {
    runs.emplace_back(first, length);
    return true;
  });
  return runs;
}

// (global index, box index, length) of every run of a range.
std::vector<std::tuple<int64_t, int64_t, int64_t>> RangeRuns(const std::vector<int64_t>& shape,
                                                             const TensorBox& box, int64_t begin,
                                                             int64_t end) {
  std::vector<std::tuple<int64_t, int64_t, int64_t>> runs;
  ForEachRangeRun(shape, box, begin, end, [&](int64_t global, int64_t in_box, int64_t length) {
    runs.emplace_back(global, in_box, length);
  });
  return runs;
}

TEST(TensorBoxTest, RunsAreRowsOrWholeSlabs) {
  // A column block: one run per row.
  auto runs = Runs({96, 32}, {{0, 16}, {96, 16}});
  ASSERT_EQ(runs.size(), 96u);
  EXPECT_EQ(runs[0], std::make_pair(std::vector<int64_t>{0, 16}, int64_t{16}));
  EXPECT_EQ(runs[95], std::make_pair(std::vector<int64_t>{95, 16}, int64_t{16}));
  // A row block spans the trailing dimension: one run.
  EXPECT_THAT(Runs({96, 32}, {{48, 0}, {48, 32}}),
              ElementsAre(std::make_pair(std::vector<int64_t>{48, 0}, int64_t{48 * 32})));
  // 3-D, spanning the last two dimensions of a block of the first.
  EXPECT_THAT(Runs({4, 3, 5}, {{1, 0, 0}, {2, 3, 5}}),
              ElementsAre(std::make_pair(std::vector<int64_t>{1, 0, 0}, int64_t{30})));
  // 3-D, a block of the middle dimension: rows of 5 (the last dimension is whole).
  EXPECT_THAT(Runs({4, 3, 5}, {{0, 1, 0}, {2, 2, 5}}),
              ElementsAre(std::make_pair(std::vector<int64_t>{0, 1, 0}, int64_t{10}),
                          std::make_pair(std::vector<int64_t>{1, 1, 0}, int64_t{10})));
  // 0-dim: one element; an empty box: nothing.
  EXPECT_THAT(Runs({}, {{}, {}}), ElementsAre(std::make_pair(std::vector<int64_t>{}, int64_t{1})));
  EXPECT_THAT(Runs({4, 6}, {{0, 2}, {4, 0}}), IsEmpty());
}

TEST(TensorBoxTest, RangeRunsVisitOnlyTheRowsOfTheRange) {
  // Elements [10, 20) of the column block [6, 4] at column 2 of a [6, 10] tensor: box rows 2..4.
  EXPECT_THAT(RangeRuns({6, 10}, {{0, 2}, {6, 4}}, 10, 20),
              ElementsAre(std::make_tuple(24, 10, 2), std::make_tuple(32, 12, 4),
                          std::make_tuple(42, 16, 4)));
  // A range of the whole tensor is one run, wherever it starts.
  EXPECT_THAT(RangeRuns({6, 10}, {{0, 0}, {6, 10}}, 13, 47),
              ElementsAre(std::make_tuple(13, 13, 34)));
  EXPECT_THAT(RangeRuns({6, 10}, {{0, 0}, {6, 10}}, 5, 5), IsEmpty());
}

TEST(TensorBoxTest, BoxProblemsAndGeometry) {
  EXPECT_EQ(BoxProblem({4, 6}, {}, {}), "");
  EXPECT_EQ(BoxProblem({4, 6}, {1, 2}, {3, 4}), "");
  EXPECT_THAT(BoxProblem({4, 6}, {1, 3}, {3, 4}),
              HasSubstr("box offset [1, 3] shape [3, 4] is out of the bounds of its global shape "
                        "[4, 6] in dimension 1"));
  EXPECT_THAT(BoxProblem({4, 6}, {1}, {3}), HasSubstr("does not have the rank"));
  EXPECT_THAT(BoxProblem({4, 6}, {0, 0}, {}), HasSubstr("does not have the rank"));
  const TensorBox whole = MakeBox({4, 6}, {}, {});
  EXPECT_THAT(whole.offset, ElementsAre(0, 0));
  EXPECT_THAT(whole.shape, ElementsAre(4, 6));
  EXPECT_EQ(FlatIndexIn({{1, 2}, {3, 4}}, {2, 5}), 7);
  EXPECT_THAT(CoordinatesOf({4, 6}, 23), ElementsAre(3, 5));
  const std::optional<TensorBox> common = Intersect({{0, 0}, {4, 4}}, {{1, 3}, {3, 3}});
  ASSERT_TRUE(common.has_value());
  EXPECT_THAT(common->offset, ElementsAre(1, 3));
  EXPECT_THAT(common->shape, ElementsAre(3, 1));
  EXPECT_FALSE(Intersect({{0, 0}, {4, 3}}, {{0, 3}, {4, 3}}).has_value());
  const TensorBox rows = RowsHolding({{0, 2}, {6, 4}}, 5, 13);
  EXPECT_THAT(rows.offset, ElementsAre(1, 2));
  EXPECT_THAT(rows.shape, ElementsAre(3, 4));
}

}  // namespace
}  // namespace tessera::trainer
