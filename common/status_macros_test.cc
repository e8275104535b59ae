#include "common/status_macros.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> ParsePositive(int value) {
  if (value <= 0) return absl::InvalidArgumentError("value: must be > 0");
  return value;
}

absl::Status CheckBoth(int a, int b, int* calls) {
  ++*calls;
  RETURN_IF_ERROR(ParsePositive(a).status());
  ++*calls;
  RETURN_IF_ERROR(ParsePositive(b).status());
  ++*calls;
  return absl::OkStatus();
}

absl::StatusOr<int> Sum(int a, int b) {
  ASSIGN_OR_RETURN(int x, ParsePositive(a));
  ASSIGN_OR_RETURN(int y, ParsePositive(b));
  return x + y;
}

absl::StatusOr<std::string> AssignToExisting(int a) {
  std::string out = "unchanged";
  int value = 0;
  ASSIGN_OR_RETURN(value, ParsePositive(a));
  out = std::to_string(value);
  return out;
}

TEST(StatusMacrosTest, ReturnIfErrorStopsAtTheFirstError) {
  int calls = 0;
  EXPECT_THAT(CheckBoth(1, -1, &calls),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be > 0")));
  EXPECT_EQ(calls, 2);
  calls = 0;
  EXPECT_THAT(CheckBoth(1, 2, &calls), IsOk());
  EXPECT_EQ(calls, 3);
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesOrAssigns) {
  EXPECT_THAT(Sum(2, 3), IsOkAndHolds(5));
  EXPECT_THAT(Sum(2, 0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("value")));
  EXPECT_THAT(AssignToExisting(7), IsOkAndHolds("7"));
  EXPECT_THAT(AssignToExisting(-7), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

TEST(StatusMatchersTest, MatchersReject) {
  EXPECT_THAT(absl::NotFoundError("x"), ::testing::Not(IsOk()));
  EXPECT_THAT(absl::NotFoundError("job x"),
              ::testing::Not(StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job"))));
  EXPECT_THAT(absl::StatusOr<int>(4), ::testing::Not(IsOkAndHolds(5)));
}

}  // namespace
}  // namespace tessera
