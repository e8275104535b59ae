// The orders and the reason of a placement, from a hand-made gang: two ranks on n1, one on n2.
#include "coordinator/scheduling/assignments.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::testing::_;
using ::testing::ElementsAre;
using ::testing::Pair;
using ::testing::SizeIs;

v1::RankPlacement Rank(int rank, const std::string& node, int local_rank, int gpu = -1) {
  v1::RankPlacement placement;
  placement.set_rank(rank);
  placement.set_node_id(node);
  placement.set_local_rank(local_rank);
  placement.set_gpu_index(gpu);
  return placement;
}

GangPlacement ThreeRanks() {
  GangPlacement placement;
  placement.job_id = "job-7";
  placement.ranks = {Rank(0, "n1", 0), Rank(1, "n1", 1), Rank(2, "n2", 0)};
  placement.master_addr = "10.0.0.1";
  placement.node_hosts = {{"n1", "10.0.0.1"}, {"n2", "10.0.0.2"}};
  return placement;
}

v1::Job Job(int attempt = 0, int64_t checkpoint_step = 0) {
  v1::Job job;
  job.set_job_id("job-7");
  job.set_attempt(attempt);
  job.mutable_spec()->mutable_resources()->set_cpu_slots(3);
  job.mutable_latest_checkpoint()->set_step(checkpoint_step);
  return job;
}

TEST(PlacementAssignmentsTest, OneAssignmentPerNodeWithEachRanksTask) {
  const v1::Job job = Job(/*attempt=*/2);
  v1::LayoutPlan plan;
  plan.set_world_size(3);
  const auto assignments = PlacementAssignments(job, job.spec(), ThreeRanks(), plan, "/ckpt");
  ASSERT_THAT(assignments, ElementsAre(Pair("n1", _), Pair("n2", _)));
  const v1::TaskAssignment& n1 = assignments.at("n1");
  EXPECT_EQ(n1.task_id(), "job-7/2/n1");
  EXPECT_EQ(n1.task_id(), TaskId("job-7", 2, "n1"));
  ASSERT_THAT(n1.trainers(), SizeIs(2));
  const v1::TrainerTask& second = n1.trainers(1);
  EXPECT_EQ(second.job_id(), "job-7");
  EXPECT_EQ(second.attempt(), 2);
  EXPECT_EQ(second.plan().world_size(), 3);
  EXPECT_EQ(second.checkpoint_directory(), "/ckpt/job-7");
  EXPECT_EQ(second.collective_timeout_seconds(), kDefaultHangTimeoutSeconds);
  EXPECT_EQ(second.assignment().rank(), 1);
  EXPECT_EQ(second.assignment().world_size(), 3);
  EXPECT_EQ(second.assignment().local_rank(), 1);
  EXPECT_EQ(second.assignment().local_world_size(), 2);
  EXPECT_EQ(second.assignment().master_addr(), "10.0.0.1");
  EXPECT_EQ(second.assignment().master_port(), 0) << "reserved at admission";
  EXPECT_EQ(second.assignment().node_addr(), "10.0.0.1");
  EXPECT_EQ(second.assignment().device_type(), v1::DEVICE_TYPE_CPU);
  const v1::TrainerTask& third = assignments.at("n2").trainers(0);
  EXPECT_EQ(third.assignment().rank(), 2);
  EXPECT_EQ(third.assignment().local_world_size(), 1);
  EXPECT_EQ(third.assignment().node_addr(), "10.0.0.2");
}

TEST(PlacementAssignmentsTest, TheSpecsDirectoryHangTimeoutAndGpusWin) {
  v1::Job job = Job();
  job.mutable_spec()->mutable_checkpoint()->set_directory("/mine");
  job.mutable_spec()->set_hang_timeout_seconds(42);
  GangPlacement placement = ThreeRanks();
  placement.ranks = {Rank(0, "n1", 0, /*gpu=*/3)};
  const auto assignments = PlacementAssignments(job, job.spec(), placement, {}, "/ckpt");
  const v1::TrainerTask& task = assignments.at("n1").trainers(0);
  EXPECT_EQ(task.checkpoint_directory(), "/mine");
  EXPECT_EQ(task.collective_timeout_seconds(), 42);
  EXPECT_EQ(task.assignment().device_type(), v1::DEVICE_TYPE_CUDA);
  EXPECT_EQ(task.assignment().gpu_index(), 3);
  EXPECT_EQ(task.spec().hang_timeout_seconds(), 42) << "every rank runs the spec it was given";
}

TEST(PlacementReasonTest, NamesTheNodesAndForALaterAttemptWhereItResumes) {
  v1::LayoutPlan plan;
  plan.set_explanation("dp 2 on 2 of the 3 slots. More follows.");
  EXPECT_EQ(PlacementReason(Job(), Job().spec(), ThreeRanks(), plan), "placed on n1, n2");
  EXPECT_EQ(PlacementReason(Job(1, 400), Job().spec(), ThreeRanks(), plan),
            "attempt 1 placed on n1, n2, resuming from the checkpoint of step 400");
  v1::JobSpec fresh = Job().spec();
  fresh.mutable_checkpoint()->set_resume(false);
  EXPECT_EQ(StartStep(Job(1, 400), fresh), 0);
  EXPECT_EQ(PlacementReason(Job(1, 400), fresh, ThreeRanks(), plan),
            "attempt 1 placed on n1, n2, resuming from the start");
  GangPlacement fewer = ThreeRanks();
  fewer.ranks.pop_back();
  EXPECT_EQ(PlacementReason(Job(1, 400), Job().spec(), fewer, plan),
            "attempt 1 placed on n1, resuming from the checkpoint of step 400; re-planned for 2 "
            "of the 3 devices asked for (dp 2 on 2 of the 3 slots)");
}

}  // namespace
}  // namespace tessera::coordinator
