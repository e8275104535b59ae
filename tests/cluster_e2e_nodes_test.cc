// The whole system when a node goes, end to end on loopback: a killed worker leaves no trainer and
// its job goes on with one node; a drained node's job checkpoints, moves and loses no step while
// the drained worker is restarted (the rolling upgrade of docs/operations.md); a job borrowing
// another queue's quota is preempted, checkpoints and resumes losing no step, and one whose
// trainers ignore the request is stopped at the deadline and resumes from its last checkpoint.


#include <signal.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

absl::Time FromProtoTime(const google::protobuf::Timestamp& time) {
  return absl::FromUnixSeconds(time.seconds()) + absl::Nanoseconds(time.nanos());
}

using ::testing::HasSubstr;

TEST_F(TwoWorkerClusterTest, KilledWorkerLeavesNoTrainerAndTheJobGoesOnWithOneNode) {
  v1::JobSpec spec = Spec(60);
  spec.set_max_restarts(1);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();
  const std::string node2_tasks = dir_.path() + "/e2e-node-2/";
  ASSERT_EQ(TrainerPids(node2_tasks).size(), 1u);
  ASSERT_THAT(worker2_->Stop(SIGKILL), IsOk());
  worker2_.reset();
  const absl::Time killed = absl::Now();
  testing::WaitUntil([&] { return TrainerPids(node2_tasks).empty(); }, absl::Seconds(5),
                     absl::Milliseconds(50));
  EXPECT_TRUE(TrainerPids(node2_tasks).empty()) << "a trainer outlived its worker";
  EXPECT_LE(absl::Now() - killed, absl::Seconds(2));

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node e2e-node-2 was lost"));
  EXPECT_EQ(job.attempts(1).world_size(), 1);
  EXPECT_EQ(job.attempts(1).node_ids(0), "e2e-node");
  EXPECT_EQ(job.plan().layout().data_parallel(), 1);
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), 60u);
  for (int i = 0; i < 60; ++i) EXPECT_EQ(curve[i].step(), i + 1);
}

class ThreeWorkerClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    third_worker_ = true;
    ClusterTest::SetUp();
  }

  v1::Node NodeNamed(const std::string& node_id) {
    v1::ListNodesRequest request;
    request.set_include_lost(true);
    v1::ListNodesResponse response;
    EXPECT_TRUE(stub_->ListNodes(Context().get(), request, &response).ok());
    for (const auto& node : response.nodes()) {
      if (node.node_id() == node_id) return node;
    }
    return v1::Node();
  }
};

// The rolling upgrade of docs/operations.md with the real binaries: a node of a running 2-node
// job is drained with --checkpoint; the job saves a checkpoint, stops and goes on on the other
// two nodes; the drained worker is restarted (the upgrade) and comes back still drained, then is
// undrained. The job, which may not restart at all (max_restarts 0), succeeds with no restart
// counted and the losses of an uninterrupted run.
TEST_F(ThreeWorkerClusterTest, ADrainedNodesJobCheckpointsMovesAndLosesNoStep) {
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(0);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 5, 120)) << Get(job_id).ShortDebugString();
  v1::Job job = Get(job_id);
  ASSERT_EQ(job.placements_size(), 2);
  const std::string drained = job.placements(1).node_id();
  const int drained_index = drained == "e2e-node" ? 0 : drained == "e2e-node-2" ? 1 : 2;

  // Not an admin action a READY node allows.
  v1::RemoveNodeRequest remove;
  remove.set_node_id(drained);
  v1::RemoveNodeResponse removed;
  EXPECT_EQ(stub_->RemoveNode(Context().get(), remove, &removed).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  v1::DrainNodeRequest drain;
  drain.set_node_id(drained);
  drain.set_checkpoint(true);
  drain.set_reason("worker upgrade");
  v1::DrainNodeResponse drain_response;
  grpc::Status status = stub_->DrainNode(Context().get(), drain, &drain_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(drain_response.node().state(), v1::NODE_STATE_DRAINING);
  ASSERT_EQ(drain_response.moving_job_ids_size(), 1);
  EXPECT_EQ(drain_response.moving_job_ids(0), job_id);

  // The job moves: attempt 1 runs on the two other nodes.
  testing::WaitUntil(
      [&] {
        job = Get(job_id);
        return (job.attempt() == 1 && job.state() == v1::JOB_STATE_RUNNING) ||
               job.state() == v1::JOB_STATE_FAILED;
      },
      absl::Seconds(120), absl::Milliseconds(100));
  ASSERT_NE(job.state(), v1::JOB_STATE_FAILED) << job.reason();
  ASSERT_EQ(job.attempt(), 1) << job.ShortDebugString();
  for (const auto& rank : job.placements()) EXPECT_NE(rank.node_id(), drained);
  EXPECT_TRUE(TrainerPids(dir_.path() + "/" + drained + "/").empty());

  // The upgrade: the drained node's worker stops and starts again (a new binary would), and
  // registers again still drained.
  std::optional<Subprocess>& worker =
      drained_index == 0 ? worker_ : drained_index == 1 ? worker2_ : worker3_;
  ASSERT_THAT(worker->Stop(SIGTERM), IsOk());
  worker.reset();
  StartWorker(drained_index, 3);
  ASSERT_FALSE(HasFatalFailure());
  testing::WaitUntil([&] { return NodeNamed(drained).state() == v1::NODE_STATE_DRAINING; },
                     absl::Seconds(30), absl::Milliseconds(100));
  v1::Node node = NodeNamed(drained);
  EXPECT_EQ(node.state(), v1::NODE_STATE_DRAINING);
  EXPECT_TRUE(node.drained());
  EXPECT_EQ(node.drain_reason(), "worker upgrade");
  v1::UndrainNodeRequest undrain;
  undrain.set_node_id(drained);
  v1::UndrainNodeResponse undrain_response;
  ASSERT_TRUE(stub_->UndrainNode(Context().get(), undrain, &undrain_response).ok());
  EXPECT_EQ(undrain_response.node().state(), v1::NODE_STATE_READY);

  job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node " + drained + " drained"));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_GE(job.attempts(1).start_step(), 5) << "resumed from the checkpoint saved for the move";
  // That checkpoint is of the last step trained before the move: no step is trained twice.
  EXPECT_EQ(job.attempts(1).start_step(), job.attempts(0).end_step());
  std::cout << "moved off " << drained << " after step " << job.attempts(0).end_step() << "\n";
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));

  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

// Preemption with the real binaries: a 2-rank job of queue vision borrows nlp's idle slot; a job
// of nlp reclaims it. The borrower saves a checkpoint and stops, waits while the nlp job runs,
// then resumes from that checkpoint with no restart counted and the losses of an uninterrupted
// run.
class QueuedClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/queues.yaml") << R"(
cohorts:
  - name: lab
queues:
  - {name: nlp, cohort: lab, nominal: {cpu_slots: 1}}
  - {name: vision, cohort: lab, nominal: {cpu_slots: 1}}
)";
    coordinator_flag_ = "--queue_file=" + dir_.path() + "/queues.yaml";
    ClusterTest::SetUp();
  }
};

TEST_F(QueuedClusterTest, ABorrowerIsPreemptedCheckpointsAndResumesWithNoStepLost) {
  constexpr int kSteps = 60;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_queue("vision");
  spec.set_max_restarts(0);
  const std::string borrower = Submit(spec);
  ASSERT_TRUE(WaitForStep(borrower, 5, 120)) << Get(borrower).ShortDebugString();

  v1::JobSpec small = Spec(5);
  small.set_name("reclaims");
  small.set_queue("nlp");
  small.mutable_resources()->set_cpu_slots(1);
  small.mutable_checkpoint()->set_directory(dir_.path() + "/reclaims");
  const std::string reclaimer = Submit(small);
  v1::Job job = WaitFor(reclaimer, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();

  job = WaitFor(borrower, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.attempts_size(), 2) << job.ShortDebugString();
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("preempted by " + reclaimer + " of queue nlp"));
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr(absl::StrCat(
                                            "checkpoint step ", job.attempts(0).end_step(),
                                            " saved in ")));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_GE(job.attempts(1).start_step(), 5) << "resumed from the checkpoint saved when preempted";
  EXPECT_EQ(job.attempts(1).start_step(), job.attempts(0).end_step());
  std::cout << "preempted after step " << job.attempts(0).end_step() << "\n";
  std::vector<v1::StepMetrics> curve = Curve(borrower);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

// No queue file, a full cluster (one worker, 2 slots): a job of higher priority preempts the
// running lower-priority one, which saves a checkpoint, stops, waits and resumes once the
// higher-priority job is done, with no restart counted and no step lost.
TEST_F(ClusterTest, AHigherPriorityJobPreemptsALowerOneOnAFullCluster) {
  constexpr int kSteps = 40;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_priority(0);
  const std::string low = Submit(spec);
  ASSERT_TRUE(WaitForStep(low, 5, 120)) << Get(low).ShortDebugString();

  v1::JobSpec urgent = Spec(5);
  urgent.set_name("urgent");
  urgent.set_priority(10);
  urgent.mutable_checkpoint()->set_directory(dir_.path() + "/urgent");
  const std::string high = Submit(urgent);
  v1::Job job = WaitFor(high, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();

  job = WaitFor(low, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.attempts_size(), 2) << job.ShortDebugString();
  EXPECT_THAT(job.attempts(0).reason(),
              HasSubstr("preempted by higher-priority " + high + " (priority 10)"));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_EQ(job.attempts(1).start_step(), job.attempts(0).end_step());
  EXPECT_LT(FromProtoTime(Get(high).end_time()), FromProtoTime(job.attempts(1).start_time()))
      << "the lower priority resumed only once the higher one was done";
  std::vector<v1::StepMetrics> curve = Curve(low);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
}

// A borrower whose trainers ignore the checkpoint request: the worker stops them at the queue
// file's deadline, and the job, PREEMPTED then PENDING, resumes from its last periodic checkpoint
// with no restart counted and every step trained once in its final curve.
class IgnoredPreemptionTest : public ClusterTest {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/queues.yaml") << R"(
cohorts:
  - name: lab
queues:
  - {name: nlp, cohort: lab, nominal: {cpu_slots: 1}}
  - {name: vision, cohort: lab, nominal: {cpu_slots: 1}}
preemption: {checkpoint_deadline: 2s}
)";
    coordinator_flag_ = "--queue_file=" + dir_.path() + "/queues.yaml";
    worker_env_ = {std::string(kFaultIgnoreCheckpointSignalEnv) + "=1"};
    ClusterTest::SetUp();
  }
};

TEST_F(IgnoredPreemptionTest, TheTrainerIsStoppedAtTheDeadlineAndResumesFromItsLastCheckpoint) {
  // Long enough not to finish within the deadline however fast the machine (the trainer runs
  // 15-70 steps a second here); the ranks keep training and saving periodic checkpoints (every
  // 100 steps) until they are stopped.
  constexpr int kSteps = 400;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_queue("vision");
  spec.set_max_restarts(0);
  spec.mutable_checkpoint()->set_interval_steps(100);
  const std::string borrower = Submit(spec);
  // The periodic checkpoint it will resume from is committed (saves are asynchronous: under
  // load, waiting only for step 102 let the stop come before step 100's commit, and the attempt
  // resumed from 0).
  ASSERT_TRUE(WaitForCheckpoint(borrower, 100, 180)) << Get(borrower).ShortDebugString();

  v1::JobSpec small = Spec(3);
  small.set_name("reclaims");
  small.set_queue("nlp");
  small.mutable_resources()->set_cpu_slots(1);
  small.mutable_checkpoint()->set_directory(dir_.path() + "/reclaims");
  const absl::Time submitted = absl::Now();
  const std::string reclaimer = Submit(small);
  v1::Job job = WaitFor(reclaimer, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  // Not before the deadline: the borrower's ranks held the slot until they were stopped.
  EXPECT_GE(absl::FromUnixNanos(job.start_time().seconds() * 1'000'000'000LL +
                                job.start_time().nanos()) -
                submitted,
            absl::Seconds(2));

  job = WaitFor(borrower, v1::JOB_STATE_SUCCEEDED, 300);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.attempts_size(), 2) << job.ShortDebugString();
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("preempted by " + reclaimer));
  EXPECT_THAT(job.attempts(0).reason(),
              HasSubstr(absl::StrCat("no checkpoint of step ", job.attempts(0).end_step(),
                                     " saved within the deadline (2s): the ranks were stopped")));
  EXPECT_FALSE(job.attempts(0).has_failure());
  const int64_t resumed = job.attempts(1).start_step();
  EXPECT_GE(resumed, 100);
  EXPECT_EQ(resumed % 100, 0) << "resumed from its last periodic checkpoint";
  EXPECT_GT(job.attempts(0).end_step(), resumed) << "it trained on until it was stopped";
  std::cout << "stopped after step " << job.attempts(0).end_step() << ", resumed from "
            << resumed << "\n";
  // The state changes on the watch stream: ... RUNNING, PREEMPTED, PENDING, SCHEDULED, ...
  std::vector<v1::JobState> states;
  for (const v1::JobEvent& event : Events(borrower)) {
    if (event.has_state_change()) states.push_back(event.state_change().new_state());
  }
  EXPECT_THAT(states, ::testing::Contains(v1::JOB_STATE_PREEMPTED));
  auto preempted = std::find(states.begin(), states.end(), v1::JOB_STATE_PREEMPTED);
  ASSERT_NE(preempted, states.end());
  ASSERT_NE(preempted + 1, states.end());
  EXPECT_EQ(*(preempted + 1), v1::JOB_STATE_PENDING);
  std::vector<v1::StepMetrics> curve = Curve(borrower);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
}

}  // namespace
}  // namespace tessera
