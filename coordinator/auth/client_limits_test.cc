#include "coordinator/auth/client_limits.h"

#include "common/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::HasSubstr;

TEST(ClientLimitsTest, SubmitRateIsATokenBucketPerUser) {
  SimulatedClock clock;
  ClientLimits limits({.submits_per_minute = 3, .clock = &clock});
  for (int i = 0; i < 3; ++i) EXPECT_THAT(limits.AdmitSubmit("alice"), IsOk());
  absl::Status refused = limits.AdmitSubmit("alice");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("retry in 20.0 s"));
  auto retry = refused.GetPayload(kRetryAfterPayload);
  ASSERT_TRUE(retry.has_value());
  EXPECT_EQ(std::string(*retry), "20000");
  // Others are not held back.
  EXPECT_THAT(limits.AdmitSubmit("bob"), IsOk());
  // One token comes back every 20 s.
  clock.Advance(absl::Seconds(10));
  refused = limits.AdmitSubmit("alice");
  EXPECT_THAT(refused.message(), HasSubstr("retry in 10.0 s"));
  clock.Advance(absl::Seconds(10));
  EXPECT_THAT(limits.AdmitSubmit("alice"), IsOk());
  EXPECT_EQ(limits.AdmitSubmit("alice").code(), absl::StatusCode::kResourceExhausted);
  // The bucket holds at most a minute's worth.
  clock.Advance(absl::Hours(1));
  for (int i = 0; i < 3; ++i) EXPECT_THAT(limits.AdmitSubmit("alice"), IsOk());
  EXPECT_EQ(limits.AdmitSubmit("alice").code(), absl::StatusCode::kResourceExhausted);
}

TEST(ClientLimitsTest, ZeroMeansUnlimited) {
  ClientLimits limits({.submits_per_minute = 0, .max_streams_per_client = 0});
  for (int i = 0; i < 1000; ++i) ASSERT_THAT(limits.AdmitSubmit("alice"), IsOk());
  std::vector<std::shared_ptr<void>> streams;
  for (int i = 0; i < 100; ++i) {
    auto slot = limits.OpenStream("alice");
    ASSERT_THAT(slot, IsOk());
    streams.push_back(*slot);
  }
}

TEST(ClientLimitsTest, StreamSlotsAreHeldUntilReleased) {
  ClientLimits limits({.max_streams_per_client = 2});
  auto first = limits.OpenStream("alice");
  auto second = limits.OpenStream("alice");
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(limits.open_streams("alice"), 2);
  auto third = limits.OpenStream("alice");
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("2 watch/log streams open"));
  EXPECT_THAT(limits.OpenStream("bob"), IsOk());
  // Copies of a slot share it; the last one gives it back.
  std::shared_ptr<void> copy = *first;
  first->reset();
  EXPECT_EQ(limits.open_streams("alice"), 2);
  copy.reset();
  EXPECT_EQ(limits.open_streams("alice"), 1);
  EXPECT_THAT(limits.OpenStream("alice"), IsOk());
}

}  // namespace
}  // namespace tessera::coordinator
