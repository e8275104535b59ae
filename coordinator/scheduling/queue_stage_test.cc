// The queue stage alone: quota admission of gang requests and the fair share it accrues, on a
// hand-made configuration and simulated times.
#include "coordinator/scheduling/queue_stage.h"

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;
using ::testing::SizeIs;
using ::testing::StartsWith;

// Cohort lab: nlp and vision, 8 GPUs each.
QueueConfig Config() {
  QueueConfig config;
  config.cohorts = {"lab"};
  config.queues = {{.name = "nlp", .cohort = "lab", .nominal = {.gpus = 8}},
                   {.name = "vision", .cohort = "lab", .nominal = {.gpus = 8}}};
  config.fair_share_half_life = absl::Hours(1);
  EXPECT_TRUE(ValidateQueueConfig(config).ok());
  return config;
}

v1::Job JobIn(const std::string& job_id, const std::string& queue) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_queue(queue);
  return job;
}

GangRequest Request(const std::string& job_id, int gpus, int64_t order) {
  GangRequest request;
  request.job_id = job_id;
  request.use_gpus = true;
  request.world_size = gpus;
  request.submit_order = order;
  return request;
}

TEST(QueueStageTest, HoldsBackWhatTheQuotaDoesNotAdmitAndHandsItOn) {
  const v1::Job fits = JobIn("fits", "nlp"), over = JobIn("over", "nlp"),
                other = JobIn("other", "vision");
  const std::map<std::string, const v1::Job*> jobs = {
      {"fits", &fits}, {"over", &over}, {"other", &other}};
  std::vector<GangRequest> requests = {Request("fits", 2, 1), Request("over", 8, 2),
                                       Request("other", 8, 3)};
  QueueStage stage;
  stage.Tracker(Config(), absl::FromUnixSeconds(0));
  const QueueStage::Held held = stage.Admit(Config(), {{"nlp", {.gpus = 4}}}, jobs, &requests);
  ASSERT_THAT(requests, SizeIs(2));
  EXPECT_EQ(requests[0].job_id, "fits");
  EXPECT_EQ(requests[1].job_id, "other");
  EXPECT_THAT(held.reasons,
              ElementsAre(Pair("over", StartsWith("queue nlp: 6 of 8 GPUs in use, needs 8"))));
  ASSERT_THAT(held.requests, SizeIs(1));
  EXPECT_EQ(held.requests[0].job_id, "over");
  EXPECT_EQ(held.requests[0].queue, "nlp");
  EXPECT_EQ(held.requests[0].devices, 8);
}

TEST(QueueStageTest, NothingToAdmitHoldsNothing) {
  QueueStage stage;
  std::vector<GangRequest> requests;
  const QueueStage::Held held = stage.Admit(Config(), {}, {}, &requests);
  EXPECT_THAT(held.reasons, IsEmpty());
  EXPECT_THAT(held.requests, IsEmpty());
}

TEST(QueueStageTest, FairShareAccruesWhatAQueueHeldAndKeepsItAcrossPasses) {
  QueueStage stage;
  EXPECT_EQ(stage.tracker(), nullptr);
  EXPECT_EQ(stage.Share(Config(), "nlp"), 0);
  const absl::Time start = absl::FromUnixSeconds(1000);
  stage.Tracker(Config(), start);
  ASSERT_NE(stage.tracker(), nullptr);
  // nlp held 8 GPUs for the hour since the previous pass; vision nothing.
  stage.Accrue(start + absl::Hours(1), {{"nlp", {.gpus = 8}}});
  const double nlp = stage.Share(Config(), "nlp");
  EXPECT_GT(nlp, 0);
  EXPECT_EQ(stage.Share(Config(), "vision"), 0);
  // A later pass's Tracker() keeps the usage (and takes the configuration's half-life).
  QueueConfig longer = Config();
  longer.fair_share_half_life = absl::Hours(2);
  EXPECT_EQ(stage.Tracker(longer, start + absl::Hours(1)).half_life(), absl::Hours(2));
  EXPECT_EQ(stage.Share(longer, "nlp"), nlp);
}

}  // namespace
}  // namespace tessera::coordinator
