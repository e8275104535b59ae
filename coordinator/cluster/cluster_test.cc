// In-process tests of Cluster's dealings with workers and attempts: registrations, heartbeats and
// reports (WorkerProtocol), failures, blame, restarts, moves and successes (AttemptFate, and the
// attempt policy), lost and drained nodes. The fixture is in cluster_fixture.h; placements,
// the loop and the cluster lock are tested in cluster_pass_test.cc.

#include "coordinator/cluster/cluster.h"

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "coordinator/cluster/cluster_fixture.h"
#include "coordinator/jobs/attempt_policy.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

TEST_F(ClusterTest, SilentNodeIsLostAndAskedToRegisterAgain) {
  Register("n1", 2);
  clock_.Advance(absl::Seconds(9));
  cluster_->Tick();
  EXPECT_EQ(cluster_->Nodes(false).size(), 1u);
  clock_.Advance(absl::Seconds(2));  // 11 s since the last heartbeat, timeout 10 s
  ClusterStats stats = cluster_->Tick();
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_LOST], 1);
  EXPECT_TRUE(cluster_->Nodes(false).empty());
  EXPECT_TRUE(Beat("n1", {}).reregister());
}

// A heartbeat's GPU metrics replace the node's (they are copied before the cluster lock and
// swapped in under it); a heartbeat with a wrong key changes nothing.
TEST_F(ClusterTest, HeartbeatGpuMetricsReplaceTheNodesLast) {
  v1::RegisterNodeRequest request;
  request.set_node_id("n1");
  request.set_address("n1:7000");
  request.set_node_key("k1");
  request.mutable_resources()->set_cpu_slots(2);
  ASSERT_THAT(cluster_->Register(request).status(), IsOk());
  auto beat = [&](const std::string& key, std::vector<double> utilization) {
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_node_id("n1");
    heartbeat.set_node_key(key);
    for (size_t i = 0; i < utilization.size(); ++i) {
      v1::GpuMetrics* gpu = heartbeat.add_gpu_metrics();
      gpu->set_index(static_cast<int>(i));
      gpu->set_utilization_percent(utilization[i]);
    }
    return cluster_->Heartbeat(heartbeat).status();
  };
  auto utilization = [&] {
    std::vector<double> out;
    const std::vector<v1::Node> nodes = cluster_->Nodes(false);
    for (const auto& gpu : nodes.at(0).gpu_metrics()) {
      out.push_back(gpu.utilization_percent());
    }
    return out;
  };
  ASSERT_THAT(beat("k1", {10, 20}), IsOk());
  EXPECT_EQ(utilization(), (std::vector<double>{10, 20}));
  ASSERT_THAT(beat("k1", {30}), IsOk());
  EXPECT_EQ(utilization(), (std::vector<double>{30}));
  EXPECT_EQ(beat("other", {99, 99}).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(utilization(), (std::vector<double>{30}));
  ASSERT_THAT(beat("k1", {}), IsOk());
  EXPECT_TRUE(utilization().empty());
}

// The coordinator placed attempt 1 to resume from step 2, the newest checkpoint it had heard of;
// its ranks found a newer one (step 4, committed by attempt 0 before the fence rose, its report
// lost with its node) and resumed there. The attempt's history says step 4, as its rank 0
// reported, not the step it was placed for.
TEST_F(ClusterTest, AnAttemptsRecordGivesTheStepItsRanksResumedFrom) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 2));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {Step(1, 5.0), Step(2, 4.0), CheckpointAt(2)}).status(),
              IsOk());
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() =
      Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n1", Now(), "killed by signal 9");
  Beat("n1", {failed});
  cluster_->Tick();
  ASSERT_THAT(Job(job_id).reason(), HasSubstr("resuming from the checkpoint of step 2"));
  StartOn(job_id, 1, "n1");
  v1::TrainerReport started;
  started.set_rank(0);
  started.mutable_started()->set_start_step(4);
  ASSERT_THAT(Relay("n1", job_id, 1, 1, {started, Step(5, 3.0), Step(6, 2.9)}).status(), IsOk());
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  const v1::Job job = Job(job_id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_THAT(job.attempts(), SizeIs(2));
  EXPECT_EQ(job.attempts(0).start_step(), 0);
  EXPECT_EQ(job.attempts(1).start_step(), 4);
  EXPECT_EQ(job.attempts(1).end_step(), 6);
}

TEST_F(ClusterTest, KilledRankRestartsFromTheCheckpointBlamingTheKilledRank) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 2));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {Step(1, 5.0), Step(2, 4.0), CheckpointAt(2), Step(3, 3.5)})
                  .status(),
              IsOk());
  EXPECT_EQ(Job(job_id).current_step(), 3);
  // Rank 0 reports its peer's loss first; the worker's record of rank 1's death comes later but
  // happened earlier, and is a cause, not a consequence.
  v1::TrainerReport peer;
  *peer.mutable_failure() =
      Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now(), "Connection closed by peer");
  ASSERT_THAT(Relay("n1", job_id, 0, 5, {peer}).status(), IsOk());
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n1",
                                      Now() - absl::Milliseconds(50), "killed by signal 9");
  failed.mutable_failure()->set_signal(9);
  Beat("n1", {failed});
  cluster_->Tick();  // every node ended: decided at once

  v1::Job job = Job(job_id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.current_step(), 2) << "metrics go on from the checkpoint's step";
  ASSERT_THAT(job.attempts(), SizeIs(1));
  EXPECT_EQ(job.attempts(0).reason(), "rank 1 on n1 was killed by signal 9 (SIGKILL) at step 3");
  ASSERT_THAT(job.attempts(0).consequences(), SizeIs(1));
  EXPECT_EQ(job.attempts(0).consequences(0).kind(), v1::FAILURE_KIND_PEER_FAILED);
  // The devices came back and the next attempt was placed in the same pass.
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(job.reason(), HasSubstr("attempt 1 placed on n1, resuming from the checkpoint of "
                                      "step 2"));
  StartOn(job_id, 1, "n1");
  // A straggling report of attempt 0 is stopped, not counted.
  v1::HeartbeatResponse orders = Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING),
                                             Task(job_id, 1, "n1", v1::TASK_STATE_RUNNING)});
  EXPECT_THAT(orders.stop(), ElementsAre(absl::StrCat(job_id, "/0/n1")));
  ASSERT_THAT(Relay("n1", job_id, 1, 1, {Step(3, 3.4), Step(4, 3.0)}).status(), IsOk());
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_THAT(job.attempts(), SizeIs(2));
  EXPECT_EQ(job.attempts(1).start_step(), 2);
  EXPECT_EQ(job.attempts(1).end_step(), 4);
  EXPECT_EQ(FreeSlots("n1"), 2);

  // The watch stream: each step once per attempt that trained it, the restart in between.
  std::vector<int64_t> steps;
  std::vector<v1::JobState> states;
  for (const auto& event : Events(job_id)) {
    if (event.has_metrics()) steps.push_back(event.metrics().step());
    if (event.has_state_change()) states.push_back(event.state_change().new_state());
  }
  EXPECT_THAT(steps, ElementsAre(1, 2, 3, 3, 4));
  EXPECT_THAT(states,
              ElementsAre(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING,
                          v1::JOB_STATE_RESTARTING, v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING,
                          v1::JOB_STATE_SUCCEEDED));
}

// A restart's rank 0 rendezvouses on another port than the failed attempt's: whatever held that
// one (the old rank 0 on its way out, a process that is not ours) may still.
TEST_F(ClusterTest, ARestartTakesAnotherMasterPortThanTheFailedAttempt) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), 29500);
  EXPECT_EQ(Job(job_id).master_port(), 29500) << "stored with the placement";
  Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING)});
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 0, "n1", Now(),
                                      "rendezvous: EADDRINUSE, address already in use");
  Beat("n1", {failed});
  cluster_->Tick();
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).trainers(0).attempt(), 1);
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), 29501);
  EXPECT_EQ(Job(job_id).master_port(), 29501);
}

TEST_F(ClusterTest, NextAttemptWaitsUntilEveryTaskOfTheFailedOneStopped) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 0, "n1", Now());
  Beat("n1", {failed});
  clock_.Advance(absl::Seconds(1));  // the blame grace: the cause is known
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RESTARTING);
  v1::HeartbeatResponse orders = Beat("n2", {Task(job_id, 0, "n2", v1::TASK_STATE_RUNNING)});
  EXPECT_THAT(orders.stop(), ElementsAre(absl::StrCat(job_id, "/0/n2")));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RESTARTING) << "n2 still runs attempt 0";
  EXPECT_EQ(FreeSlots("n2"), 0);
  Beat("n2", {Task(job_id, 0, "n2", v1::TASK_STATE_STOPPED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(Job(job_id).attempt(), 1);
}

TEST_F(ClusterTest, CauseReportedByAnotherNodeWithinTheGraceIsBlamed) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  // n1's rank reports its peer gone; n2's worker reports the killed rank a heartbeat later.
  v1::TaskStatus consequence = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *consequence.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now());
  Beat("n1", {consequence});
  clock_.Advance(absl::Seconds(3));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "only a consequence so far";
  v1::TaskStatus cause = Task(job_id, 0, "n2", v1::TASK_STATE_FAILED);
  *cause.mutable_failure() = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n2",
                                     Now() - absl::Seconds(3), "killed by signal 9");
  cause.mutable_failure()->set_signal(9);
  Beat("n2", {cause});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().node_id(), "n2");
  EXPECT_THAT(job.reason(), HasSubstr("rank 1 on n2 was killed by signal 9"));
  EXPECT_EQ(FreeSlots("n1"), 1);
  EXPECT_EQ(FreeSlots("n2"), 1);
}

TEST_F(ClusterTest, OnlyConsequencesAreBlamedAfterTheSettleTime) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  v1::TrainerReport peer;
  *peer.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now(), "peer lost");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {peer}).status(), IsOk());
  clock_.Advance(absl::Seconds(4));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING);
  clock_.Advance(absl::Seconds(1));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(job_id).failure().kind(), v1::FAILURE_KIND_PEER_FAILED);
}

TEST_F(ClusterTest, NonRetryableFailureEndsTheJobWithRestartsLeft) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 3));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_DATA_ERROR, 0, "n1", Now(), "bad shard");
  Beat("n1", {failed});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_THAT(job.reason(), HasSubstr("not retried"));
}

TEST_F(ClusterTest, JobFailingEveryAttemptStopsAfterMaxRestartsWithEveryReason) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 2));
  cluster_->Tick();
  for (int attempt = 0; attempt <= 2; ++attempt) {
    StartOn(job_id, attempt, "n1");
    v1::TaskStatus failed = Task(job_id, attempt, "n1", v1::TASK_STATE_FAILED);
    *failed.mutable_failure() =
        Failure(v1::FAILURE_KIND_NAN_LOSS, 0, "n1", Now(), absl::StrCat("nan #", attempt));
    Beat("n1", {failed});
    cluster_->Tick();
  }
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 2);
  ASSERT_THAT(job.attempts(), SizeIs(3));
  for (int attempt = 0; attempt <= 2; ++attempt) {
    EXPECT_THAT(job.attempts(attempt).reason(), HasSubstr(absl::StrCat("nan #", attempt)));
  }
  EXPECT_THAT(job.reason(), HasSubstr("no restarts left"));
  EXPECT_EQ(FreeSlots("n1"), 2);
}

TEST_F(ClusterTest, StoreFailuresAreRetriedAndNoAllocationLeaks) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  bool fail_writes = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail_writes && id == job_id ? absl::UnavailableError("injected: database is locked")
                                       : absl::OkStatus();
  });
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 1, "n1", Now());
  Beat("n1", {failed});
  cluster_->Tick();
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "the decision could not be stored";
  EXPECT_EQ(FreeSlots("n1"), 0) << "the attempt keeps its devices until its end is recorded";
  fail_writes = false;
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).restarts(), 1);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);

  // Success that cannot be recorded at first is recorded by a later tick, and frees the slots.
  StartOn(job_id, 1, "n1");
  fail_writes = true;
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(FreeSlots("n1"), 0);
  fail_writes = false;
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(FreeSlots("n1"), 2);
}

TEST_F(ClusterTest, NodeRecordWriteFailureIsRetried) {
  Register("n1", 2);
  bool fail = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail && id == "n1" ? absl::UnavailableError("injected") : absl::OkStatus();
  });
  clock_.Advance(absl::Seconds(11));
  cluster_->Tick();  // n1 lost; its record cannot be written
  fail = false;
  cluster_->Tick();
  auto nodes = store_->ListNodes();
  ASSERT_THAT(nodes.status(), IsOk());
  ASSERT_THAT(*nodes, SizeIs(1));
  EXPECT_EQ((*nodes)[0].state(), v1::NODE_STATE_LOST);
}

TEST_F(ClusterTest, ResentReportBatchAddsEachStepOnce) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  const std::vector<v1::TrainerReport> batch = {Step(1, 5.0), Step(2, 4.5), CheckpointAt(2)};
  // The worker's first call was stored but its response lost: it sends the batch again, then
  // the batch extended by one report.
  ASSERT_THAT(Relay("n1", job_id, 0, 1, batch).status(), IsOk());
  auto again = Relay("n1", job_id, 0, 1, batch);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->acked_sequence(), 3);
  std::vector<v1::TrainerReport> longer = batch;
  longer.push_back(Step(3, 4.0));
  ASSERT_THAT(Relay("n1", job_id, 0, 1, longer).status(), IsOk());
  std::vector<int64_t> steps;
  int checkpoints = 0;
  for (const auto& event : Events(job_id)) {
    if (event.has_metrics()) steps.push_back(event.metrics().step());
    checkpoints += event.has_checkpoint();
  }
  EXPECT_THAT(steps, ElementsAre(1, 2, 3));
  EXPECT_EQ(checkpoints, 1);
}

TEST_F(ClusterTest, LostNodeRestartsAnAutomaticLayoutOnWhatIsLeft) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).plan().world_size(), 2);
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  // n2 goes silent; n1's rank loses its peer.
  for (int i = 0; i < 6; ++i) {
    clock_.Advance(absl::Seconds(2));
    Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING)});
    cluster_->Tick();
  }
  v1::TaskStatus consequence = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *consequence.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now());
  Beat("n1", {consequence});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NODE_LOST);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node n2 was lost"));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(job.plan().world_size(), 1);
  EXPECT_EQ(job.plan().layout().data_parallel(), 1);
  EXPECT_THAT(job.reason(), HasSubstr("re-planned for 1 of the 2 devices"));
  v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  ASSERT_THAT(orders.start(0).trainers(), SizeIs(1));
  const v1::TrainerTask& task = orders.start(0).trainers(0);
  EXPECT_EQ(task.assignment().world_size(), 1);
  EXPECT_EQ(task.spec().resources().cpu_slots(), 1);
  EXPECT_EQ(task.spec().batch().global_batch_size(), 8) << "the same global batch";
  EXPECT_EQ(task.checkpoint_directory(), "/ckpt/" + job_id);
}

TEST_F(ClusterTest, StragglerIsTheRankWithTheMostBusyTime) {
  Register("n1", 2);
  Register("n2", 1);
  v1::JobSpec spec = CpuSpec(3, 0);
  spec.mutable_batch()->set_global_batch_size(12);
  const std::string job_id = Submit(spec);
  cluster_->Tick();
  v1::HeartbeatResponse n1 = Beat("n1", {});
  v1::HeartbeatResponse n2 = Beat("n2", {});
  ASSERT_EQ(n1.start_size() + n2.start_size(), 2);
  auto with_ranks = [&](const std::string& node, std::vector<std::pair<int, double>> busy) {
    v1::TaskStatus status = Task(job_id, 0, node, v1::TASK_STATE_RUNNING);
    for (const auto& [rank, seconds] : busy) {
      v1::RankStepTime* time = status.add_ranks();
      time->set_rank(rank);
      time->set_step(10);
      time->set_step_seconds(0.5);
      time->set_busy_seconds(seconds);
    }
    return status;
  };
  Beat("n1", {with_ranks("n1", {{0, 0.10}, {1, 0.11}})});
  Beat("n2", {with_ranks("n2", {{2, 0.40}})});
  auto report = cluster_->Straggler(job_id);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->slowest_rank(), 2);
  EXPECT_EQ(report->slowest_node_id(), "n2");
  EXPECT_NEAR(report->median_busy_seconds(), 0.11, 1e-9);
  EXPECT_NEAR(report->skew(), 0.40 / 0.11, 1e-9);
  EXPECT_TRUE(report->straggling());
  ClusterStats stats = cluster_->Tick();
  ASSERT_TRUE(stats.stragglers.contains(job_id));
  EXPECT_EQ(stats.stragglers[job_id].ranks_size(), 3);
}

TEST(AttemptPolicyTest, BlamesTheEarliestCauseOverEarlierConsequences) {
  const absl::Time t = absl::FromUnixSeconds(100);
  std::vector<v1::TrainerFailure> failures = {
      Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", t),
      Failure(v1::FAILURE_KIND_PROCESS_EXIT, 3, "n2", t + absl::Seconds(2)),
      Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 1, "n1", t + absl::Seconds(1)),
  };
  EXPECT_EQ(BlameIndex(failures), 2u);
  failures.pop_back();
  EXPECT_EQ(BlameIndex(failures), 1u);
  failures.pop_back();
  EXPECT_EQ(BlameIndex(failures), 0u);
}

TEST(AttemptPolicyTest, RetriesWhatARestartCanOutrun) {
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_PROCESS_EXIT));
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_NODE_LOST));
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT));
  EXPECT_FALSE(IsRetryable(v1::FAILURE_KIND_INVALID_SPEC));
  EXPECT_FALSE(IsRetryable(v1::FAILURE_KIND_DATA_ERROR));
}

TEST(AttemptPolicyTest, DescribesFailuresForPeople) {
  v1::TrainerFailure killed = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n1", absl::Now());
  killed.set_signal(9);
  killed.set_step(32);
  EXPECT_EQ(DescribeFailure(killed), "rank 1 on n1 was killed by signal 9 (SIGKILL) at step 32");
  v1::TrainerFailure hung = Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 2, "n3", absl::Now(),
                                    "rank 2 on n3 hung: no heartbeat for 5.1 s\nmore detail");
  EXPECT_EQ(DescribeFailure(hung),
            "rank 2 on n3 failed: COLLECTIVE_TIMEOUT: rank 2 on n3 hung: no heartbeat for 5.1 s");
  v1::TrainerFailure lost =
      Failure(v1::FAILURE_KIND_NODE_LOST, -1, "n2", absl::Now(), "no heartbeat for 16s");
  EXPECT_EQ(DescribeFailure(lost), "node n2 was lost: no heartbeat for 16s");
}

// A node speaks for its own attempts only, and only with the key it registered with.
TEST_F(ClusterTest, NodesReportOnlyForTheirOwnAttemptsWithTheirKey) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  const std::string placed = Job(job_id).placements(0).node_id();
  const std::string other = placed == "n1" ? "n2" : "n1";
  StartOn(job_id, 0, placed);
  auto forged = Relay(other, job_id, 0, 1, {Step(1, 5.0)});
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(forged.status().message(), HasSubstr("which does not run there"));
  EXPECT_THAT(Relay(placed, job_id, 0, 1, {Step(1, 5.0)}).status(), IsOk());
  EXPECT_EQ(Job(job_id).current_step(), 1);

  // n1 registered without a key; a worker with a key cannot take its id over while it lives.
  v1::RegisterNodeRequest takeover;
  takeover.set_node_id("n1");
  takeover.set_address("elsewhere:7000");
  takeover.set_node_key("another-key");
  takeover.mutable_resources()->set_cpu_slots(2);
  EXPECT_EQ(cluster_->Register(takeover).status().code(), absl::StatusCode::kAlreadyExists);
  v1::HeartbeatRequest beat;
  beat.set_node_id("n1");
  beat.set_node_key("another-key");
  EXPECT_EQ(cluster_->Heartbeat(beat).status().code(), absl::StatusCode::kPermissionDenied);
}

// A drained node takes no new placement, runs what it has to its end, and takes work again once
// undrained.
TEST_F(ClusterTest, ADrainedNodeGetsNoNewWorkUntilUndrained) {
  Register("n1", 2);
  const std::string running = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(running, 0, "n1");
  auto drained = cluster_->DrainNode("n1", /*checkpoint=*/false, "kernel upgrade");
  ASSERT_THAT(drained.status(), IsOk());
  EXPECT_EQ(drained->node().state(), v1::NODE_STATE_DRAINING);
  EXPECT_THAT(drained->remaining_job_ids(), ElementsAre(running));
  EXPECT_TRUE(drained->moving_job_ids().empty());
  EXPECT_EQ(drained->node().drain_reason(), "kernel upgrade");
  v1::HeartbeatResponse orders = Beat("n1", {Task(running, 0, "n1", v1::TASK_STATE_RUNNING)});
  EXPECT_TRUE(orders.stop().empty()) << "a plain drain stops nothing";
  EXPECT_TRUE(orders.checkpoint_and_stop().empty());
  Beat("n1", {Task(running, 0, "n1", v1::TASK_STATE_SUCCEEDED)});
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_SUCCEEDED);

  const std::string waiting = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  EXPECT_EQ(Job(waiting).state(), v1::JOB_STATE_PENDING) << "the only node is drained";
  EXPECT_TRUE(Beat("n1", {}).start().empty());
  auto undrained = cluster_->UndrainNode("n1");
  ASSERT_THAT(undrained.status(), IsOk());
  EXPECT_EQ(undrained->state(), v1::NODE_STATE_READY);
  cluster_->Tick();
  EXPECT_EQ(Job(waiting).state(), v1::JOB_STATE_SCHEDULED);
  StartOn(waiting, 0, "n1");

  EXPECT_EQ(cluster_->DrainNode("nope", false, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cluster_->UndrainNode("nope").status().code(), absl::StatusCode::kNotFound);
}

// Drain with checkpoint: every node of the attempt is asked to checkpoint and stop (not a plain
// stop); failures while it stops are not blamed; once all its tasks ended, the job goes back to
// the queue from the new checkpoint, is placed off the drained node, and counts no restart.
TEST_F(ClusterTest, DrainWithCheckpointMovesTheJobWithoutCountingARestart) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 0));  // no restarts allowed at all
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {Step(1, 5.0), Step(2, 4.5), CheckpointAt(2), Step(3, 4.0)})
                  .status(),
              IsOk());
  Register("n3", 1);

  auto drained = cluster_->DrainNode("n2", /*checkpoint=*/true, "");
  ASSERT_THAT(drained.status(), IsOk());
  EXPECT_THAT(drained->moving_job_ids(), ElementsAre(job_id));
  for (const std::string node : {"n1", "n2"}) {
    v1::HeartbeatResponse orders = Beat(node, {Task(job_id, 0, node, v1::TASK_STATE_RUNNING)});
    EXPECT_THAT(orders.checkpoint_and_stop(), ElementsAre(absl::StrCat(job_id, "/0/", node)))
        << node;
    EXPECT_TRUE(orders.stop().empty()) << node;
  }
  // The ranks save step 4 and exit; n1's rank 0 reports the checkpoint; a peer's exit seen as a
  // failure on n2 (it stopped first) is recorded but decides nothing.
  ASSERT_THAT(Relay("n1", job_id, 0, 5, {Step(4, 3.8), CheckpointAt(4)}).status(), IsOk());
  v1::TaskStatus peer_gone = Task(job_id, 0, "n2", v1::TASK_STATE_FAILED);
  *peer_gone.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 1, "n2", Now());
  Beat("n2", {peer_gone});
  clock_.Advance(absl::Seconds(10));  // past every settle time
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "n1 has not stopped yet";
  Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_STOPPED)});
  cluster_->Tick();

  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.current_step(), 4) << "resumes from the checkpoint saved for the move";
  ASSERT_THAT(job.attempts(), SizeIs(1));
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node n2 drained"));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_TRUE(Beat("n2", {}).start().empty()) << "nothing new on the drained node";
  StartOn(job_id, 1, "n1");
  StartOn(job_id, 1, "n3");

  // Removing: only a drained or lost node that holds nothing.
  EXPECT_EQ(cluster_->RemoveNode("n1").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_THAT(cluster_->DrainNode("n1", false, "").status(), IsOk());
  absl::Status busy = cluster_->RemoveNode("n1");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(busy.message(), HasSubstr(job_id));
  ASSERT_THAT(cluster_->RemoveNode("n2"), IsOk());
  EXPECT_EQ(cluster_->RemoveNode("n2").code(), absl::StatusCode::kNotFound);
  ClusterStats stats = cluster_->Tick();
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_DRAINING], 1);  // n1
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_READY], 1);     // n3
  EXPECT_TRUE(Beat("n2", {}).reregister()) << "a removed node's worker registers as a new node";
}

// A job cancelled while it moves is not queued again.
TEST_F(ClusterTest, AJobCancelledWhileItMovesStaysCancelled) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  const std::string node = Job(job_id).placements(0).node_id();
  StartOn(job_id, 0, node);
  ASSERT_THAT(cluster_->DrainNode(node, true, "").status(), IsOk());
  ASSERT_THAT(jobs_->Cancel(job_id, "test").status(), IsOk());
  Beat(node, {Task(job_id, 0, node, v1::TASK_STATE_STOPPED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(Job(job_id).attempt(), 0);
}

}  // namespace
}  // namespace tessera::coordinator
