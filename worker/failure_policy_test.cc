#include "worker/failure_policy.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::worker {
namespace {

using ::testing::HasSubstr;

const absl::Time kT0 = absl::FromUnixSeconds(1700000000);

v1::TrainerFailure Failure(int rank, v1::FailureKind kind, absl::Duration after_t0) {
  v1::TrainerFailure failure;
  failure.set_rank(rank);
  failure.set_kind(kind);
  *failure.mutable_time() = ToTimestamp(kT0 + after_t0);
  return failure;
}

TEST(BlameFailureTest, TheEarliestCauseWinsOverEarlierConsequences) {
  // Rank 1 lost its peer first; rank 0's crash, seen later, is the cause.
  const std::vector<v1::TrainerFailure> failures = {
      Failure(1, v1::FAILURE_KIND_PEER_FAILED, absl::Milliseconds(10)),
      Failure(2, v1::FAILURE_KIND_OUT_OF_MEMORY, absl::Milliseconds(300)),
      Failure(0, v1::FAILURE_KIND_PROCESS_EXIT, absl::Milliseconds(200))};
  std::optional<v1::TrainerFailure> blamed = BlameFailure(failures);
  ASSERT_TRUE(blamed.has_value());
  EXPECT_EQ(blamed->rank(), 0);
  EXPECT_EQ(blamed->kind(), v1::FAILURE_KIND_PROCESS_EXIT);
}

TEST(BlameFailureTest, OnlyConsequencesBlameTheEarliest) {
  const std::vector<v1::TrainerFailure> failures = {
      Failure(3, v1::FAILURE_KIND_PEER_FAILED, absl::Milliseconds(50)),
      Failure(1, v1::FAILURE_KIND_PEER_FAILED, absl::Milliseconds(20))};
  EXPECT_EQ(BlameFailure(failures)->rank(), 1);
  EXPECT_FALSE(BlameFailure({}).has_value());
}

TEST(AwaitCauseTest, WaitsOnlyForPeerFailuresWhileARankRunsWithinGrace) {
  const std::vector<v1::TrainerFailure> consequences = {
      Failure(1, v1::FAILURE_KIND_PEER_FAILED, absl::ZeroDuration())};
  const absl::Duration grace = absl::Seconds(1);
  EXPECT_TRUE(AwaitCause(consequences, true, kT0, kT0 + absl::Milliseconds(500), grace));
  EXPECT_FALSE(AwaitCause(consequences, true, kT0, kT0 + absl::Seconds(1), grace)) << "grace over";
  EXPECT_FALSE(AwaitCause(consequences, false, kT0, kT0 + absl::Milliseconds(500), grace))
      << "no rank left to report the cause";
  std::vector<v1::TrainerFailure> with_cause = consequences;
  with_cause.push_back(Failure(0, v1::FAILURE_KIND_NAN_LOSS, absl::ZeroDuration()));
  EXPECT_FALSE(AwaitCause(with_cause, true, kT0, kT0 + absl::Milliseconds(500), grace))
      << "the cause is known";
}

TEST(HangTest, SilenceCountsFromLaunchUntilTheFirstHeartbeat) {
  EXPECT_EQ(Silence(kT0, std::nullopt, kT0 + absl::Seconds(7)), absl::Seconds(7));
  EXPECT_EQ(Silence(kT0, kT0 + absl::Seconds(5), kT0 + absl::Seconds(7)), absl::Seconds(2));
  v1::JobSpec spec;
  EXPECT_EQ(HangTimeout(spec), absl::Seconds(300));
  spec.set_hang_timeout_seconds(5);
  EXPECT_EQ(HangTimeout(spec), absl::Seconds(5));
}

TEST(HangTest, HungRankFailureNamesRankNodeSilenceAndState) {
  const v1::TrainerFailure failure =
      HungRankFailure(1, "n1", 17, absl::Milliseconds(5200), 'T', kT0);
  EXPECT_EQ(failure.kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  EXPECT_EQ(failure.rank(), 1);
  EXPECT_EQ(failure.node_id(), "n1");
  EXPECT_EQ(failure.step(), 17);
  EXPECT_EQ(FromTimestamp(failure.time()), kT0);
  EXPECT_EQ(failure.message(),
            "rank 1 on n1 hung: no heartbeat for 5.2 s (process state: stopped)");
  EXPECT_THAT(HungRankFailure(0, "n2", 0, absl::Seconds(300), 'D', kT0).message(),
              HasSubstr("uninterruptible I/O wait"));
}

}  // namespace
}  // namespace tessera::worker
