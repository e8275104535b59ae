#include "coordinator/queues/queue_preemption.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

QueueConfig Config() {
  QueueConfig config;
  config.cohorts = {"lab"};
  config.queues = {
      {.name = "nlp", .cohort = "lab", .nominal = {.gpus = 32}},
      {.name = "vision", .cohort = "lab", .nominal = {.gpus = 16}},
      {.name = "speech", .cohort = "lab", .nominal = {.gpus = 16}},
  };
  EXPECT_TRUE(ValidateQueueConfig(config).ok());
  return config;
}

RunningJob Job(std::string job_id, std::string queue, int64_t gpus, int priority,
               absl::Duration since_checkpoint) {
  return {.job_id = std::move(job_id),
          .queue = std::move(queue),
          .priority = priority,
          .use_gpus = true,
          .devices = gpus,
          .since_checkpoint = since_checkpoint};
}

std::vector<std::string> Ids(const PreemptionDecision& decision) {
  std::vector<std::string> ids;
  for (const Victim& victim : decision.victims) ids.push_back(victim.job_id);
  return ids;
}

QueuedRequest Waiting(std::string queue, int64_t gpus, int priority = 0) {
  return {.job_id = "waiting", .queue = std::move(queue), .priority = priority, .devices = gpus};
}

TEST(SelectPreemptionTest, ReclaimsFromBorrowersLowestPriorityThenLeastProgressLost) {
  // nlp holds 8 of its 32; vision borrows 24 beyond its 16 (40), speech 16 (at nominal).
  const std::vector<RunningJob> running = {
      Job("nlp-1", "nlp", 8, 0, absl::Minutes(1)),
      Job("v-important", "vision", 8, 5, absl::Minutes(1)),
      Job("v-fresh", "vision", 8, 1, absl::Minutes(2)),
      Job("v-stale", "vision", 8, 1, absl::Hours(3)),
      Job("v-low", "vision", 16, 0, absl::Hours(5)),
      Job("s-low", "speech", 16, 0, absl::Minutes(1)),
  };
  // nlp wants 16 (within its nominal): the cohort (64) has 0 unused.
  PreemptionDecision decision = SelectPreemption(Config(), running, Waiting("nlp", 16));
  // v-low first (priority 0); speech is not borrowing so s-low is never a candidate.
  EXPECT_THAT(Ids(decision), ElementsAre("v-low"));
  EXPECT_THAT(decision.victims[0].reason,
              HasSubstr("reclaimed for queue nlp (below its nominal 32 GPUs, waiting needs 16): "
                        "queue vision borrows 24 GPUs"));
  EXPECT_EQ(decision.victims[0].kind, PreemptionKind::kReclaim);
  EXPECT_STREQ(PreemptionKindName(decision.victims[0].kind), "reclaim");
  EXPECT_THAT(decision.reason, HasSubstr("reclaim 1 job(s) borrowing from cohort lab"));

  // 24: v-low, then among priority 1 the one with less progress to lose.
  decision = SelectPreemption(Config(), running, Waiting("nlp", 24));
  EXPECT_THAT(Ids(decision), ElementsAre("v-low", "v-fresh"));

  // Reclaim is the queue's nominal right: the waiting job's priority does not matter.
  decision = SelectPreemption(Config(), running, Waiting("nlp", 16, -10));
  EXPECT_THAT(Ids(decision), ElementsAre("v-low"));
}

TEST(SelectPreemptionTest, HigherPriorityPreemptsLowerInTheSameQueue) {
  const std::vector<RunningJob> running = {
      Job("n-low-old", "nlp", 16, 0, absl::Hours(2)),
      Job("n-low-new", "nlp", 8, 0, absl::Minutes(5)),
      Job("n-mid", "nlp", 8, 3, absl::Minutes(1)),
      Job("vision-1", "vision", 16, 0, absl::Minutes(1)),
      Job("speech-1", "speech", 16, 0, absl::Minutes(1)),
  };
  // nlp is full (32 of 32); nobody borrows. Priority 5 needing 8: the cheapest lower one.
  PreemptionDecision decision = SelectPreemption(Config(), running, Waiting("nlp", 8, 5));
  EXPECT_THAT(Ids(decision), ElementsAre("n-low-new"));
  EXPECT_THAT(decision.victims[0].reason,
              HasSubstr("preempted by higher-priority waiting (priority 5) in queue nlp"));
  EXPECT_EQ(decision.victims[0].kind, PreemptionKind::kPriority);
  EXPECT_STREQ(PreemptionKindName(decision.victims[0].kind), "priority");
  // Needing 32 takes every lower-priority job, never other queues' jobs within their quota.
  decision = SelectPreemption(Config(), running, Waiting("nlp", 32, 5));
  EXPECT_THAT(Ids(decision), ElementsAre("n-low-new", "n-low-old", "n-mid"));
  // Equal priority preempts nothing.
  decision = SelectPreemption(Config(), running, Waiting("nlp", 8, 3));
  EXPECT_THAT(Ids(decision), ElementsAre("n-low-new"));
  decision = SelectPreemption(Config(), running, Waiting("nlp", 8, 0));
  EXPECT_THAT(decision.victims, IsEmpty());
  EXPECT_THAT(decision.reason, HasSubstr("would not free enough"));
}

TEST(SelectPreemptionTest, NothingForAJobThatFitsOrCanNeverRun) {
  const std::vector<RunningJob> running = {Job("n", "nlp", 8, 0, absl::Minutes(1))};
  EXPECT_THAT(SelectPreemption(Config(), running, Waiting("nlp", 8)).reason,
              HasSubstr("fits its queue's quota"));
  EXPECT_THAT(SelectPreemption(Config(), running, Waiting("nlp", 65)).reason,
              HasSubstr("preemption cannot help"));
  EXPECT_THAT(SelectPreemption(QueueConfig{}, running, Waiting("default", 8)).reason,
              HasSubstr("no queues are configured"));
  // Another resource's jobs are never victims for a GPU job.
  const std::vector<RunningJob> cpu = {
      {.job_id = "c", .queue = "vision", .use_gpus = false, .devices = 100}};
  EXPECT_THAT(SelectPreemption(Config(), cpu, Waiting("nlp", 8)).victims, IsEmpty());
}

TEST(SelectPreemptionTest, ABorrowingQueueDoesNotReclaim) {
  // nlp already at nominal wants more; vision borrows. Reclaim is for queues below nominal only.
  const std::vector<RunningJob> running = {
      Job("n", "nlp", 32, 9, absl::Minutes(1)),
      Job("v", "vision", 32, 0, absl::Minutes(1)),
  };
  const PreemptionDecision decision = SelectPreemption(Config(), running, Waiting("nlp", 8, 9));
  EXPECT_THAT(decision.victims, IsEmpty());
  EXPECT_THAT(decision.reason, HasSubstr("nothing to preempt"));
}

// The whole cycle: vision borrows nlp's idle quota, nlp's demand returns and waits with a reason,
// preemption picks the borrowers, and once they stop nlp is admitted.
TEST(SelectPreemptionTest, BorrowThenReclaimThenAdmit) {
  const QueueConfig config = Config();
  std::vector<RunningJob> running = {Job("s", "speech", 16, 0, absl::Minutes(1))};
  std::map<std::string, Resources> in_use = {{"speech", {.gpus = 16}}};
  std::vector<QueuedRequest> vision_jobs;
  for (int i = 0; i < 6; ++i) {
    vision_jobs.push_back(
        {.job_id = absl::StrCat("v", i), .queue = "vision", .submit_order = i, .devices = 8});
  }
  QuotaAdmission admission = AdmitByQuota(config, in_use, {}, vision_jobs);
  // 16 within vision's nominal, then 32 borrowed from idle nlp: the cohort is full.
  ASSERT_THAT(admission.admitted, ElementsAre("v0", "v1", "v2", "v3", "v4", "v5"));
  EXPECT_EQ(admission.borrowing.size(), 4u);
  for (int i = 0; i < 6; ++i) {
    running.push_back(Job(absl::StrCat("v", i), "vision", 8, 0, absl::Minutes(10 * (6 - i))));
  }
  in_use["vision"].gpus = 48;

  const QueuedRequest nlp = Waiting("nlp", 16);
  admission = AdmitByQuota(config, in_use, {}, {nlp});
  EXPECT_THAT(admission.admitted, IsEmpty());
  EXPECT_EQ(admission.held.at("waiting"),
            "queue nlp: 0 of 32 GPUs in use, needs 16, but cohort lab has lent its quota out: 64 "
            "of 64 GPUs in use there (waits for borrowed GPUs to come back)");

  const PreemptionDecision decision = SelectPreemption(config, running, nlp);
  // Least progress lost first: v5 and v4 checkpointed most recently.
  ASSERT_THAT(Ids(decision), ElementsAre("v5", "v4"));
  in_use["vision"].gpus -= 16;
  admission = AdmitByQuota(config, in_use, {}, {nlp});
  EXPECT_THAT(admission.admitted, ElementsAre("waiting"));
}

}  // namespace
}  // namespace tessera::coordinator
