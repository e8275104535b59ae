// The control plane without a single point of failure, end to end: two coordinators on one
// private PostgreSQL database (tests/postgres_fixture.h), one worker given both addresses, a
// 2-rank CPU job and `tessera watch` given both addresses. `kill -9` of the leader mid-training:
// the standby leads, the worker follows it without restarting its trainers, the job succeeds with
// an uninterrupted run's losses, the store holds every step and every event once, and the watch
// prints every step once, with no gap. Skipped with the fixture's reason when PostgreSQL cannot
// start.

#include <signal.h>

#include <map>
#include <regex>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"
#include "tests/postgres_fixture.h"

namespace tessera {
namespace {

using ::tessera::testing::PostgresCluster;

class FailoverClusterTest : public ClusterTest {
 protected:
  void SetUp() override {
    url_ = PostgresCluster::Shared().NewDatabase();
    if (url_.empty()) GTEST_SKIP() << PostgresCluster::Shared().Reason();
    ClusterTest::SetUp();
  }

  void TearDown() override {
    if (standby_) {
      EXPECT_THAT(standby_->Stop(SIGTERM), IsOk());
    }
    ClusterTest::TearDown();
  }

  // The first coordinator leads (epoch 1); the second stands by on a port of its own.
  void StartCoordinator() override {
    coordinator_.emplace(StartOne());
    if (HasFatalFailure()) return;
    address_ = StandbyAddress(*coordinator_);
    ASSERT_THAT(coordinator_->WaitForStderrLine("leading with epoch 1 "), IsOk());
    ASSERT_THAT(coordinator_->WaitForStderrLine("serving gRPC on " + address_), IsOk());
    standby_.emplace(StartOne());
    if (HasFatalFailure()) return;
    standby_address_ = StandbyAddress(*standby_);
    worker_coordinators_ = address_ + "," + standby_address_;
  }

  Subprocess StartOne() {
    auto process = Subprocess::Start(
        {BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0", "--metrics_listen=",
         "--state=" + url_, "--leader_lease_seconds=2", "--standby_poll_seconds=0.2",
         "--checkpoint_root=" + dir_.path() + "/ckpt",
         absl::StrCat("--master_port_base=", 40000 + (getpid() % 2000) * 10),
         "--heartbeat_interval=500ms", "--heartbeat_timeout=10s"});
    EXPECT_THAT(process, IsOk());
    if (!process.ok()) std::abort();
    return std::move(*process);
  }

  static std::string StandbyAddress(Subprocess& process) {
    auto line = process.WaitForStderrLine("standby serving gRPC on");
    EXPECT_THAT(line, IsOk());
    if (!line.ok()) return "";
    std::smatch match;
    std::regex_search(*line, match, std::regex(R"(serving gRPC on (\S+:\d+))"));
    return match[1];
  }

  std::string url_;
  std::optional<Subprocess> standby_;
  std::string standby_address_;
};

TEST_F(FailoverClusterTest, KillingTheLeaderMidTrainingLosesNothingAndRestartsNoTrainer) {
  constexpr int kSteps = 300;
  const v1::JobSpec spec = Spec(kSteps);
  const std::string job_id = Submit(spec);
  ASSERT_FALSE(job_id.empty());
  ASSERT_TRUE(WaitForStep(job_id, 15, 120)) << Get(job_id).reason();
  const std::vector<pid_t> trainers = TrainerPids(dir_.path() + "/e2e-node/");
  ASSERT_EQ(trainers.size(), 2u);

  // A watcher given both addresses, as a user's terminal would be.
  auto watch = Subprocess::Start({BinDir() + "/tessera", "watch", job_id,
                                  "--coordinator=" + worker_coordinators_},
                                 {.merge_stdout = true});
  ASSERT_THAT(watch, IsOk());
  ASSERT_THAT(watch->WaitForStderrLine("step "), IsOk());

  ASSERT_THAT(coordinator_->Stop(SIGKILL), IsOk());
  coordinator_.reset();
  const absl::Time killed = absl::Now();
  ASSERT_THAT(standby_->WaitForStderrLine("leading with epoch 2 ", absl::Seconds(30)), IsOk());
  ASSERT_THAT(standby_->WaitForStderrLine("serving gRPC on " + standby_address_), IsOk());
  const absl::Duration failover = absl::Now() - killed;
  EXPECT_LE(failover, absl::Seconds(10)) << "the lease (2 s), the poll and loading the state";
  stub_ = v1::Coordinator::NewStub(MakeClientChannel(standby_address_));
  // The trainers of before train on: the worker kept them through the failover.
  EXPECT_EQ(TrainerPids(dir_.path() + "/e2e-node/"), trainers);

  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  // The same attempt, the same trainer processes: the failover restarted nothing.
  EXPECT_EQ(job.attempts_size(), 1);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_TRUE(TrainerPids(dir_.path() + "/e2e-node/").empty());

  // Every step once, and every event once, numbered without a gap.
  const std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
  const std::vector<v1::JobEvent> events = Events(job_id);
  ASSERT_FALSE(events.empty());
  std::map<int64_t, int> steps_in_events;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].sequence(), static_cast<int64_t>(i + 1));
    if (events[i].has_metrics()) ++steps_in_events[events[i].metrics().step()];
  }
  EXPECT_EQ(steps_in_events.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, count] : steps_in_events) EXPECT_EQ(count, 1) << "step " << step;

  // The watch followed the new leader: every step printed once, in order.
  auto watched = watch->Wait(absl::Seconds(60));
  ASSERT_THAT(watched, IsOk());
  EXPECT_EQ(watched->exit_code, 0) << watch->stderr_text();
  std::vector<int> printed;
  const std::string& text = watch->stderr_text();
  const std::regex step_line(R"(\] step (\d+)/\d+  loss)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), step_line);
       it != std::sregex_iterator(); ++it) {
    printed.push_back(std::stoi((*it)[1]));
  }
  ASSERT_FALSE(printed.empty()) << text;
  for (size_t i = 1; i < printed.size(); ++i) {
    EXPECT_EQ(printed[i], printed[i - 1] + 1) << "the watch skipped or repeated a step";
  }
  EXPECT_EQ(printed.back(), kSteps);

  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

}  // namespace
}  // namespace tessera
