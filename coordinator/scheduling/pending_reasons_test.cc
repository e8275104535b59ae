// The pending-reason stage alone: which reasons a pass stores, on a simulated timeline.
#include "coordinator/scheduling/pending_reasons.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

v1::Job Stored(const std::string& job_id, const std::string& reason,
               v1::JobState state = v1::JOB_STATE_PENDING) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_state(state);
  job.set_reason(reason);
  return job;
}

TEST(ReasonShapeTest, ReplacesEveryNumberWithOneMark) {
  EXPECT_EQ(ReasonShape("quota: 56 of 64 GPUs in use, share 0.75"),
            "quota: # of # GPUs in use, share #");
  EXPECT_EQ(ReasonShape("ends with a dot 3."), "ends with a dot #.");
  EXPECT_EQ(ReasonShape("no figures"), "no figures");
}

TEST(PendingReasonsTest, WritesANewReasonAndNotTheOneStored) {
  PendingReasons reasons;
  const absl::Time now = absl::FromUnixSeconds(1000);
  const std::vector<v1::Job> listed = {Stored("a", "queued"), Stored("b", "no node has 8 GPUs")};
  EXPECT_THAT(
      reasons.ToWrite({{"a", "no node has 4 GPUs"}, {"b", "no node has 8 GPUs"}}, listed, now),
      ElementsAre(Pair("a", "no node has 4 GPUs")));
}

TEST(PendingReasonsTest, AReasonWhoseFiguresAloneChangedWaitsForTheRefresh) {
  PendingReasons reasons;
  const absl::Time start = absl::FromUnixSeconds(1000);
  EXPECT_THAT(reasons.ToWrite({{"a", "56 of 64 GPUs in use"}}, {Stored("a", "queued")}, start),
              ElementsAre(Pair("a", "56 of 64 GPUs in use")));
  const std::vector<v1::Job> listed = {Stored("a", "56 of 64 GPUs in use")};
  // Same shape, new figures: held back until kRefresh has passed since the last write.
  EXPECT_THAT(reasons.ToWrite({{"a", "60 of 64 GPUs in use"}}, listed, start + absl::Seconds(1)),
              IsEmpty());
  // Another shape goes out at once.
  EXPECT_THAT(reasons.ToWrite({{"a", "no node has 8 GPUs"}}, listed, start + absl::Seconds(2)),
              ElementsAre(Pair("a", "no node has 8 GPUs")));
  const std::vector<v1::Job> now_listed = {Stored("a", "no node has 8 GPUs")};
  EXPECT_THAT(reasons.ToWrite({{"a", "no node has 16 GPUs"}}, now_listed, start + absl::Seconds(3)),
              IsEmpty());
  EXPECT_THAT(reasons.ToWrite({{"a", "no node has 16 GPUs"}}, now_listed,
                              start + absl::Seconds(2) + PendingReasons::kRefresh),
              ElementsAre(Pair("a", "no node has 16 GPUs")));
}

TEST(PendingReasonsTest, ARestartingJobKeepsItsReasonAndUnlistedJobsAreSkipped) {
  PendingReasons reasons;
  const std::vector<v1::Job> listed = {
      Stored("r", "restarting: rank 3 lost", v1::JOB_STATE_RESTARTING)};
  EXPECT_THAT(reasons.ToWrite({{"r", "no node has 8 GPUs"}, {"gone", "queued"}}, listed,
                              absl::FromUnixSeconds(1000)),
              IsEmpty());
}

TEST(PendingReasonsTest, AJobThatLeftAndCameBackIsWrittenAtOnce) {
  PendingReasons reasons;
  const absl::Time start = absl::FromUnixSeconds(1000);
  reasons.ToWrite({{"a", "56 of 64 GPUs in use"}}, {Stored("a", "queued")}, start);
  reasons.Keep({});  // placed: no longer waiting
  EXPECT_THAT(reasons.ToWrite({{"a", "60 of 64 GPUs in use"}},
                              {Stored("a", "56 of 64 GPUs in use")}, start + absl::Seconds(1)),
              ElementsAre(Pair("a", "60 of 64 GPUs in use")));
}

}  // namespace
}  // namespace tessera::coordinator
