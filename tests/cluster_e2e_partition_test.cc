// The whole system when the network partitions rather than a process dies: the coordinator and
// two workers on hosts of their own (network namespaces cabled to one bridge,
// tests/util/netns.h), one rank of a job on each worker. A worker cut off from the coordinator for
// less than the heartbeat timeout costs nothing; one cut off for longer is given up, its job moves
// on without it, and when the worker comes back none of its stale trainers is left running; two
// workers cut off from each other block their ranks' collectives, which time out after the
// job's hang timeout (their heartbeats go on), and the job restarts once the network heals. Needs root (as CI runs); skips otherwise with the reason.

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kCoordinatorHost = 0;
constexpr int kFirstWorkerHost = 1;
constexpr int kSecondWorkerHost = 2;

class PartitionTest : public TwoWorkerClusterTest {
 protected:
  void SetUp() override {
    auto lab = testing::NetnsLab::Create(3);
    if (!lab.ok()) GTEST_SKIP() << lab.status().message();
    lab_ = std::move(*lab);
    coordinator_flag_ = heartbeat_timeout_flag_;
    TwoWorkerClusterTest::SetUp();
  }

  void TearDown() override {
    if (lab_ == nullptr) return;
    for (const auto& [a, b] : partitions_) EXPECT_THAT(lab_->Heal(a, b), IsOk());
    TwoWorkerClusterTest::TearDown();
  }

  void Partition(int a, int b) {
    ASSERT_THAT(lab_->Partition(a, b), IsOk());
    partitions_.push_back({a, b});
  }
  void Heal(int a, int b) {
    ASSERT_THAT(lab_->Heal(a, b), IsOk());
    std::erase(partitions_, std::pair<int, int>{a, b});
  }

  // A job with one rank on each worker.
  v1::JobSpec TwoNodeSpec(int steps) {
    v1::JobSpec spec = Spec(steps);
    spec.mutable_resources()->set_cpu_slots(2);
    return spec;
  }

  void ExpectEveryStepOnce(const std::string& job_id, int steps) {
    std::vector<v1::StepMetrics> curve = Curve(job_id);
    ASSERT_EQ(curve.size(), static_cast<size_t>(steps));
    for (int i = 0; i < steps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  }

  std::string heartbeat_timeout_flag_ = "--heartbeat_timeout=3s";
  std::vector<std::pair<int, int>> partitions_;
};

class ShortPartitionTest : public PartitionTest {
 protected:
  void SetUp() override {
    heartbeat_timeout_flag_ = "--heartbeat_timeout=15s";
    PartitionTest::SetUp();
  }
};

TEST_F(ShortPartitionTest, AWorkerCutOffFromTheCoordinatorBrieflyLosesNothing) {
  const std::string job_id = Submit(TwoNodeSpec(80));
  ASSERT_TRUE(WaitForStep(job_id, 10, 120)) << Get(job_id).reason();
  ASSERT_EQ(TrainerPids(dir_.path() + "/e2e-node-2/").size(), 1u);

  // The ranks keep training over the workers' link; the cut-off worker keeps its rank's reports
  // and delivers them once the coordinator answers again.
  Partition(kCoordinatorHost, kSecondWorkerHost);
  const int64_t before = Get(job_id).current_step();
  // Cut off until the coordinator has not heard from the worker for 4 s: several heartbeats
  // missed, well within the 15 s timeout.
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        v1::ListNodesResponse nodes;
        if (!stub_->ListNodes(Context().get(), {}, &nodes).ok()) return false;
        for (const v1::Node& node : nodes.nodes()) {
          if (node.node_id() != "e2e-node-2") continue;
          const absl::Time heard = absl::FromUnixSeconds(node.last_heartbeat_time().seconds()) +
                                   absl::Nanoseconds(node.last_heartbeat_time().nanos());
          return absl::Now() - heard >= absl::Seconds(4);
        }
        return false;
      },
      absl::Seconds(12), absl::Milliseconds(100)))
      << "the coordinator still hears the cut-off worker";
  Heal(kCoordinatorHost, kSecondWorkerHost);

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.attempts_size(), 1) << "a partition shorter than the heartbeat timeout restarted "
                                       "the job";
  EXPECT_GT(job.current_step(), before);
  ExpectEveryStepOnce(job_id, 80);
}

TEST_F(PartitionTest, AWorkerCutOffPastItsTimeoutIsGivenUpAndLeavesNoStaleTrainer) {
  v1::JobSpec spec = TwoNodeSpec(60);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();
  const std::string node2_tasks = dir_.path() + "/e2e-node-2/";
  ASSERT_EQ(TrainerPids(node2_tasks).size(), 1u);

  Partition(kCoordinatorHost, kSecondWorkerHost);
  // The coordinator gives the node up after its heartbeat timeout and trains on with one node.
  ASSERT_TRUE(testing::WaitUntil(
      [&] { return Get(job_id).attempts_size() >= 2; },
      absl::Seconds(60), absl::Milliseconds(100)))
      << Get(job_id).ShortDebugString();
  // The cut-off rank lost its peer (stopped by the coordinator on the reachable node): it must
  // not train on alone, whatever the coordinator can tell it.
  EXPECT_TRUE(testing::WaitUntil([&] { return TrainerPids(node2_tasks).empty(); },
                                 absl::Seconds(30), absl::Milliseconds(100)))
      << "a stale trainer of the first attempt still runs on the cut-off node";
  Heal(kCoordinatorHost, kSecondWorkerHost);

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("e2e-node-2"));
  EXPECT_EQ(job.attempts(1).world_size(), 1);
  EXPECT_EQ(job.attempts(1).node_ids(0), "e2e-node");
  ExpectEveryStepOnce(job_id, 60);
  // The worker that came back registered again and is usable.
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        v1::ListNodesResponse nodes;
        if (!stub_->ListNodes(Context().get(), {}, &nodes).ok()) return false;
        for (const v1::Node& node : nodes.nodes()) {
          if (node.node_id() == "e2e-node-2" && node.state() == v1::NODE_STATE_READY) return true;
        }
        return false;
      },
      absl::Seconds(30), absl::Milliseconds(100)));
}

TEST_F(PartitionTest, WorkersCutOffFromEachOtherHangIsFoundAndTheJobRecovers) {
  v1::JobSpec spec = TwoNodeSpec(60);
  spec.set_max_restarts(3);
  spec.set_hang_timeout_seconds(8);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForStep(job_id, 12, 120)) << Get(job_id).reason();

  // Both workers still reach the coordinator; their ranks cannot reach each other.
  Partition(kFirstWorkerHost, kSecondWorkerHost);
  const absl::Time cut = absl::Now();
  // The first attempt's end is recorded when its ranks fail; the next waits for the network.
  ASSERT_TRUE(testing::WaitUntil([&] { return Get(job_id).restarts() >= 1; },
                                 absl::Seconds(60), absl::Milliseconds(100)))
      << Get(job_id).ShortDebugString();
  const absl::Duration detected = absl::Now() - cut;
  Heal(kFirstWorkerHost, kSecondWorkerHost);

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 300);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  const v1::TrainerFailure& hang = job.attempts(0).failure();
  EXPECT_EQ(hang.kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT) << hang.ShortDebugString();
  EXPECT_LE(detected, absl::Seconds(8 + 12)) << "the collective timeout (the hang timeout) + the "
                                                "blame window";
  ExpectEveryStepOnce(job_id, 60);
}

}  // namespace
}  // namespace tessera
