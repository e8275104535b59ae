// The planning stage alone: jobs as JobManager stores them (their submitted plan from PlanJob),
// the free capacity as the pass's snapshot leaves it, no store and no cluster.
#include "coordinator/scheduling/plan_stage.h"

#include <set>
#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "coordinator/admission/job_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

v1::Job WaitingJob(const std::string& job_id, int slots,
                   v1::JobState state = v1::JOB_STATE_PENDING) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_state(state);
  *job.mutable_spec() = testing::TinyCpuJobSpec(job_id, slots);
  auto plan = PlanJob(job.spec());
  EXPECT_THAT(plan.status(), IsOk());
  if (plan.ok()) *job.mutable_plan() = *plan;
  return job;
}

NodeCapacity CpuNode(const std::string& node_id, int free_slots,
                     int64_t host_memory_bytes = int64_t{64} << 30) {
  NodeCapacity node;
  node.node_id = node_id;
  node.host = node_id;
  node.free_cpu_slots = free_slots;
  node.total_cpu_slots = free_slots;
  node.host_memory_bytes = host_memory_bytes;
  return node;
}

std::vector<std::string> Ids(const std::vector<GangRequest>& requests) {
  std::vector<std::string> ids;
  for (const GangRequest& request : requests) ids.push_back(request.job_id);
  return ids;
}

TEST(PlanStageTest, PlansTheWaitingJobsForTheFreeDevicesAndSkipsTheOthers) {
  const std::vector<v1::Job> listed = {WaitingJob("a", 2), WaitingJob("held", 2),
                                       WaitingJob("b", 4)};
  PlanStage stage;
  const PlannedJobs planned = stage.Run(listed, {"a", "b"}, {CpuNode("n1", 4)});
  EXPECT_THAT(Ids(planned.requests), ElementsAre("a", "b"));
  EXPECT_EQ(planned.requests[0].world_size, 2);
  EXPECT_EQ(planned.requests[1].world_size, 4);
  EXPECT_FALSE(planned.requests[0].use_gpus);
  EXPECT_EQ(planned.jobs.at("b"), &listed[2]);
  EXPECT_TRUE(planned.plans.at("a").fits());
  EXPECT_EQ(planned.plans.at("b").world_size(), 4);
  EXPECT_FALSE(planned.jobs.contains("held"));
  EXPECT_THAT(planned.unfit, IsEmpty());
  EXPECT_EQ(stage.plans_made(), 2);
}

TEST(PlanStageTest, SetsAsideAJobNoLayoutFitsWithThePlannersExplanation) {
  const std::vector<v1::Job> listed = {WaitingJob("big", 2)};
  PlanStage stage;
  // 1 MiB of host memory shared by two slots holds no model.
  const PlannedJobs planned = stage.Run(listed, {"big"}, {CpuNode("n1", 2, int64_t{1} << 20)});
  EXPECT_THAT(planned.requests, IsEmpty());
  ASSERT_TRUE(planned.unfit.contains("big"));
  EXPECT_THAT(planned.unfit.at("big"), Not(IsEmpty()));
  EXPECT_FALSE(planned.jobs.contains("big"));
}

TEST(PlanStageTest, AJobWithNoMatchingNodeKeepsItsSubmittedPlanAndIsRequested) {
  v1::Job job = WaitingJob("gpu", 2);
  job.mutable_spec()->mutable_resources()->set_cpu_slots(0);
  job.mutable_spec()->mutable_resources()->set_gpus(2);
  const std::vector<v1::Job> listed = {job};
  PlanStage stage;
  const PlannedJobs planned = stage.Run(listed, {"gpu"}, {CpuNode("n1", 4)});
  // The scheduler, not the planner, says why it waits.
  ASSERT_THAT(planned.requests, SizeIs(1));
  EXPECT_TRUE(planned.requests[0].use_gpus);
  EXPECT_EQ(planned.plans.at("gpu").SerializeAsString(), job.plan().SerializeAsString());
}

TEST(PlanStageTest, ARestartingJobThatLostDevicesIsFittedToWhatIsFree) {
  const std::vector<v1::Job> listed = {WaitingJob("r", 4, v1::JOB_STATE_RESTARTING)};
  PlanStage stage;
  const PlannedJobs planned = stage.Run(listed, {"r"}, {CpuNode("n1", 2)});
  ASSERT_THAT(planned.requests, SizeIs(1));
  EXPECT_EQ(planned.requests[0].world_size, 2);
  EXPECT_EQ(planned.specs.at("r").resources().cpu_slots(), 2);
  EXPECT_EQ(PlanStage::RequestedDevices(listed[0].spec()), 4) << "the stored spec is unchanged";
  // A pending job (not restarting) waits for all it asked for instead.
  const std::vector<v1::Job> pending = {WaitingJob("p", 4)};
  const PlannedJobs waits = stage.Run(pending, {"p"}, {CpuNode("n1", 2)});
  ASSERT_THAT(waits.requests, SizeIs(1));
  EXPECT_EQ(waits.requests[0].world_size, 4);
}

TEST(PlanStageTest, PlansAreCachedUntilTheTargetChangesAndForgottenWhenAJobLeaves) {
  const std::vector<v1::Job> listed = {WaitingJob("a", 2)};
  PlanStage stage;
  stage.Run(listed, {"a"}, {CpuNode("n1", 4)});
  stage.Run(listed, {"a"}, {CpuNode("n1", 4)});
  EXPECT_EQ(stage.plans_made(), 1) << "the same target planned again";
  // A larger node changes the target (devices per node): planned again.
  stage.Run(listed, {"a"}, {CpuNode("n1", 8)});
  EXPECT_EQ(stage.plans_made(), 2);
  // Placed (no longer waiting): forgotten, so a restart plans afresh.
  stage.Run(listed, {}, {CpuNode("n1", 8)});
  stage.Run(listed, {"a"}, {CpuNode("n1", 8)});
  EXPECT_EQ(stage.plans_made(), 3);
}

}  // namespace
}  // namespace tessera::coordinator
