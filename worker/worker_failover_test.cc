// WorkerAgent and coordinators that fail over (the HA contract, docs/coordinator.md; the
// worker without a coordinator), in-process on simulated time with fake trainers and fake
// coordinators on 127.0.0.1: the worker follows a new leader and registers its running tasks with
// it, ignores the orders of a deposed leader's lower epoch, keeps its trainers and their reports
// while no leader answers, and past its coordinator grace asks them to checkpoint and stop and
// reports their end when a leader answers again.
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_matchers.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "worker/agent_sim_fixture.h"
#include "worker/contact_metrics.h"
#include "worker/coordinator_fake.h"
#include "worker/sim_fake.h"
#include "worker/worker_agent.h"

namespace tessera::worker {
namespace {

using agent_test::Behaviour;
using agent_test::FakeCoordinator;
using agent_test::FakeLauncher;
using agent_test::FakeRank;
using agent_test::IsTerminal;
using agent_test::kTaskId;
using agent_test::ServeOnLoopback;
using agent_test::StateIn;
using agent_test::SteppedClock;
using agent_test::TwoRanks;
using ::tessera::testing::IsOk;
using ::testing::IsEmpty;

// Signals and kills a fake rank received (its events' names).
std::vector<std::string> What(FakeRank& rank) {
  std::vector<std::string> what;
  for (const auto& event : rank.events()) what.push_back(event.what);
  return what;
}

class WorkerFailoverTest : public agent_test::AgentSimFixture {
 protected:
  // One fake coordinator per entry of `epochs` (its leader epoch), each handing out the same task;
  // the worker lists them in that order.
  void Start(const std::vector<int64_t>& epochs, WorkerAgentOptions options) {
    std::vector<std::string> addresses;
    for (int64_t epoch : epochs) {
      auto& coordinator =
          coordinators_.emplace_back(std::make_unique<FakeCoordinator>(TwoRanks(0), &clock_));
      coordinator->set_heartbeat_interval_seconds(2);
      coordinator->set_leader_epoch(epoch);
      servers_.push_back(ServeOnLoopback(coordinator.get(), &addresses.emplace_back()));
      ASSERT_NE(servers_.back(), nullptr);
    }
    options.coordinator_address = absl::StrJoin(addresses, ",");
    addresses_ = addresses;
    // A leader that never comes back fails a call in a moment, not after 10 s of real time.
    options.rpc_timeout = absl::Seconds(2);
    StartAgent(std::move(options));
  }

  void TearDown() override {
    StopAgent();
    for (auto& server : servers_) server->Shutdown();
  }

  FakeCoordinator& coordinator(int i) { return *coordinators_[i]; }

  // Whether both ranks run and `i`'s latest heartbeat says so.
  bool RunningAt(int i) {
    const auto heartbeats = coordinator(i).heartbeats();
    return launcher_.ranks().size() == 2 && !heartbeats.empty() &&
           StateIn(heartbeats.back().request, kTaskId) == v1::TASK_STATE_RUNNING;
  }

  // Both ranks heartbeat (step `step`), so they count as reporting and are not hung.
  void RanksHeartbeat() {
    ++step_;
    for (int rank = 0; rank < 2; ++rank) SendHeartbeat(rank, step_);
  }

  // Whether a registration with coordinator `i` listed the task in `state`.
  bool RegisteredTask(int i, v1::TaskState state) {
    for (const auto& registration : coordinator(i).registrations()) {
      for (const auto& task : registration.running_tasks()) {
        if (task.task_id() == kTaskId && task.state() == state) return true;
      }
    }
    return false;
  }

  std::vector<std::unique_ptr<FakeCoordinator>> coordinators_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
  int64_t step_ = 0;
};

// Standby first in the list: the worker registers with the leader it names. The leader then dies
// (refuses, no hint) and the standby takes over with a higher epoch: the worker registers again
// with it, listing the running task, and its trainers never notice.
TEST_F(WorkerFailoverTest, FollowsTheNewLeaderAndRegistersTheRunningTasks) {
  Start({0, 1}, WorkerAgentOptions());
  coordinator(0).StandBy(addresses_[1]);
  ASSERT_TRUE(RunUntil([&] { return RunningAt(1); }, absl::Minutes(1)));
  EXPECT_THAT(coordinator(0).registrations(), IsEmpty());
  EXPECT_EQ(agent_->Contact().leader_epoch, 1);

  coordinator(1).StandBy("");
  coordinator(0).set_leader_epoch(2);
  coordinator(0).Lead();
  ASSERT_TRUE(RunUntil([&] { return RunningAt(0); }, absl::Minutes(1), [&] { RanksHeartbeat(); }));
  EXPECT_TRUE(RegisteredTask(0, v1::TASK_STATE_RUNNING))
      << "the new leader was not told of the running task";
  EXPECT_EQ(agent_->Contact().leader_epoch, 2);
  EXPECT_TRUE(agent_->Contact().reachable);
  ASSERT_EQ(launcher_.ranks().size(), 2u) << "the task was started twice";
  for (const auto& rank : launcher_.ranks()) {
    EXPECT_THAT(What(*rank), IsEmpty()) << "rank " << rank->rank() << " was signalled";
  }
}

// A deposed leader (lower epoch) orders the task stopped: the worker ignores it, and obeys the
// same order from the leader.
TEST_F(WorkerFailoverTest, IgnoresTheOrdersOfALowerEpoch) {
  Start({5}, WorkerAgentOptions());
  ASSERT_TRUE(RunUntil([&] { return RunningAt(0); }, absl::Minutes(1)));
  std::atomic<int64_t> answer_epoch{4};
  std::atomic<int> stale_answers{0};
  coordinator(0).OnHeartbeat([&](const v1::HeartbeatRequest&, v1::HeartbeatResponse* response) {
    response->set_leader_epoch(answer_epoch.load());
    if (answer_epoch.load() < 5) ++stale_answers;
    response->add_stop(kTaskId);
  });
  ASSERT_TRUE(RunUntil([&] { return stale_answers.load() >= 3; }, absl::Minutes(1),
                       [&] { RanksHeartbeat(); }));
  for (const auto& rank : launcher_.ranks()) {
    EXPECT_THAT(What(*rank), IsEmpty()) << "a deposed leader's stop reached rank " << rank->rank();
  }
  EXPECT_FALSE(IsTerminal(coordinator(0).last_status().state()));
  EXPECT_EQ(agent_->Contact().leader_epoch, 5);

  answer_epoch = 5;
  ASSERT_TRUE(RunUntil([&] { return IsTerminal(coordinator(0).last_status().state()); },
                       absl::Minutes(1), [&] { RanksHeartbeat(); }));
  EXPECT_EQ(coordinator(0).last_status().state(), v1::TASK_STATE_STOPPED);
}

// The coordinator goes away. Within the grace the trainers keep running and their reports are
// kept; past it their ranks are asked to save a checkpoint and stop; when a leader answers again
// the worker registers with the stopped task and relays the reports kept meanwhile.
TEST_F(WorkerFailoverTest, PastTheGraceWithoutALeaderTrainersCheckpointAndStop) {
  constexpr absl::Duration kGrace = absl::Seconds(60);
  WorkerAgentOptions options;
  options.coordinator_grace = kGrace;
  options.checkpoint_grace = absl::Seconds(30);
  launcher_.Behave(0, Behaviour{.exit_on_checkpoint = true});
  launcher_.Behave(1, Behaviour{.exit_on_checkpoint = true});
  Start({0}, options);
  ASSERT_TRUE(RunUntil([&] { return RunningAt(0); }, absl::Minutes(1), [&] { RanksHeartbeat(); }));
  RanksHeartbeat();
  ASSERT_TRUE(RunUntil([&] { return agent_->Contact().reachable; }, absl::Minutes(1)));

  coordinator(0).StandBy("");
  ASSERT_TRUE(RunUntil([&] { return !agent_->Contact().reachable; }, absl::Minutes(1),
                       [&] { RanksHeartbeat(); }));
  const absl::Time lost = clock_.Now();
  // A report while nobody leads: kept for the next leader.
  v1::TrainerReport kept;
  kept.mutable_metrics()->set_step(42);
  SendReport(0, kept);

  ASSERT_FALSE(RunUntil([&] { return !What(*launcher_.ranks()[0]).empty(); }, kGrace - 5 * kStep,
                        [&] { RanksHeartbeat(); }))
      << "signalled within the grace";
  EXPECT_GE(agent_->Contact().without, kGrace - 8 * kStep);
  EXPECT_FALSE(agent_->Contact().reachable);
  // What /metrics says meanwhile.
  const CoordinatorContactMetrics metrics([this] { return agent_->Contact(); });
  const std::vector<prometheus::MetricFamily> families = metrics.Collect();
  ASSERT_EQ(families.size(), 2u);
  EXPECT_EQ(families[0].name, "tessera_worker_coordinator_reachable");
  EXPECT_EQ(families[0].metric.at(0).gauge.value, 0);
  EXPECT_EQ(families[1].name, "tessera_worker_seconds_without_coordinator");
  EXPECT_GE(families[1].metric.at(0).gauge.value, absl::ToDoubleSeconds(kGrace - 8 * kStep));

  ASSERT_TRUE(RunUntil(
      [&] {
        for (const auto& rank : launcher_.ranks()) {
          if (What(*rank).empty()) return false;
        }
        return true;
      },
      absl::Minutes(1), [&] { RanksHeartbeat(); }));
  EXPECT_GE(clock_.Now() - lost, kGrace - 3 * kStep);
  for (const auto& rank : launcher_.ranks()) {
    EXPECT_THAT(What(*rank),
                ::testing::ElementsAre(absl::StrCat("signal ", kCheckpointAndStopSignal)))
        << "rank " << rank->rank() << " was not asked for a checkpoint only";
  }
  EXPECT_FALSE(IsTerminal(coordinator(0).last_status().state()));

  coordinator(0).Lead();
  ASSERT_TRUE(
      RunUntil([&] { return IsTerminal(coordinator(0).last_status().state()); }, absl::Minutes(2)));
  EXPECT_EQ(coordinator(0).last_status().state(), v1::TASK_STATE_STOPPED);
  EXPECT_TRUE(agent_->Contact().reachable);
  EXPECT_EQ(agent_->Contact().without, absl::ZeroDuration());
  EXPECT_EQ(metrics.Collect()[0].metric.at(0).gauge.value, 1);
  ASSERT_GE(coordinator(0).registrations().size(), 2u) << "no registration once it led again";
  bool relayed = false;
  for (const v1::TrainerReport& report : coordinator(0).relayed()) {
    relayed |= report.has_metrics() && report.metrics().step() == 42;
  }
  EXPECT_TRUE(relayed) << "the report kept while no leader answered was lost";
}

}  // namespace
}  // namespace tessera::worker
