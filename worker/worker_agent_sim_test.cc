// WorkerAgent in-process on a simulated clock, with fake trainers (a TrainerLauncher whose ranks
// exit, ignore SIGTERM, save a checkpoint or stay silent as a test says) and the fake coordinator
// on 127.0.0.1: a task from launch to its reported end, the hang watchdog, the stop grace and the
// checkpoint grace, each timed on simulated time, with no trainer process and no sleep.
// worker_agent_test.cc checks the same agent end to end with real processes.
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "common/trainer_env.h"
#include "gmock/gmock.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "worker/agent_sim_fixture.h"
#include "worker/coordinator_fake.h"
#include "worker/failure_policy.h"
#include "worker/sim_fake.h"
#include "worker/trainer_launcher.h"
#include "worker/worker_agent.h"

namespace tessera::worker {
namespace {

using agent_test::Behaviour;
using agent_test::Event;
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
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The node heartbeat period the fake coordinator hands out: longer than a step, so a heartbeat
// that comes sooner was woken.
constexpr double kHeartbeatSeconds = 10;
std::vector<std::string> What(const std::vector<Event>& events) {
  std::vector<std::string> what;
  for (const Event& event : events) what.push_back(event.what);
  return what;
}

class WorkerAgentSimTest : public agent_test::AgentSimFixture {
 protected:
  void Start(v1::TaskAssignment assignment, WorkerAgentOptions options) {
    coordinator_ = std::make_unique<FakeCoordinator>(std::move(assignment), &clock_);
    coordinator_->set_heartbeat_interval_seconds(kHeartbeatSeconds);
    server_ = ServeOnLoopback(coordinator_.get(), &options.coordinator_address);
    ASSERT_NE(server_, nullptr);
    StartAgent(std::move(options));
  }

  void TearDown() override {
    StopAgent();
    if (server_) server_->Shutdown();
  }

  v1::TaskState LastHeartbeatState() {
    const std::vector<FakeCoordinator::Exchange> heartbeats = coordinator_->heartbeats();
    return heartbeats.empty() ? v1::TASK_STATE_UNSPECIFIED
                              : StateIn(heartbeats.back().request, kTaskId);
  }
  bool Running() {
    return launcher_.ranks().size() == 2 && LastHeartbeatState() == v1::TASK_STATE_RUNNING;
  }
  bool Ended() { return IsTerminal(coordinator_->last_status().state()); }
  // When the first heartbeat carrying the task's end arrived.
  absl::Time EndArrival() {
    for (const FakeCoordinator::Exchange& exchange : coordinator_->heartbeats()) {
      if (IsTerminal(StateIn(exchange.request, kTaskId))) return exchange.at;
    }
    return absl::InfiniteFuture();
  }

  // Whether the last heartbeat carried a step time of both ranks (their reports were read).
  bool BothRanksHeard() {
    const std::vector<FakeCoordinator::Exchange> heartbeats = coordinator_->heartbeats();
    if (heartbeats.empty()) return false;
    for (const v1::TaskStatus& status : heartbeats.back().request.tasks()) {
      if (status.task_id() == kTaskId) return status.ranks_size() == 2;
    }
    return false;
  }

  std::unique_ptr<FakeCoordinator> coordinator_;
  std::unique_ptr<grpc::Server> server_;
};

// Launch -> running -> every rank exits 0 -> SUCCEEDED, sent at once (the supervise loop wakes the
// heartbeat), and the task forgotten once the coordinator has it.
TEST_F(WorkerAgentSimTest, RanksThatExitZeroSucceedAndTheEndGoesOutAtOnce) {
  Start(TwoRanks(0), WorkerAgentOptions());
  ASSERT_TRUE(RunUntil([&] { return Running(); }, absl::Minutes(1)));
  // Right after a heartbeat: the next periodic one is kHeartbeatSeconds away.
  const size_t seen = coordinator_->heartbeats().size();
  ASSERT_TRUE(RunUntil([&] { return coordinator_->heartbeats().size() > seen; }, absl::Minutes(1)));
  const absl::Time exited = clock_.Now();
  for (const auto& rank : launcher_.ranks()) rank->Exit(0);

  ASSERT_TRUE(RunUntil([&] { return Ended(); }, absl::Minutes(1)));
  EXPECT_EQ(coordinator_->last_status().state(), v1::TASK_STATE_SUCCEEDED);
  EXPECT_LE(EndArrival() - exited, 3 * kStep) << "the end waited for the periodic heartbeat";
  for (const auto& rank : launcher_.ranks()) {
    EXPECT_THAT(What(rank->events()), IsEmpty()) << "rank " << rank->rank() << " was signalled";
  }
  // Forgotten after the heartbeat that carried the end.
  ASSERT_TRUE(RunUntil([&] { return LastHeartbeatState() == v1::TASK_STATE_UNSPECIFIED; },
                       absl::Minutes(1)));
  EXPECT_EQ(agent_->NodeView().job_ids_size(), 0);
}

// A rank silent for its job's hang timeout is condemned then, not before; it gets SIGKILL (a
// stopped process only queues a SIGTERM) and its sibling the ordinary stop.
TEST_F(WorkerAgentSimTest, ARankThatNeverHeartbeatsIsHungAfterTheTimeoutAndKilled) {
  constexpr absl::Duration kHang = absl::Seconds(60);
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(30);
  Start(TwoRanks(absl::ToInt64Seconds(kHang)), options);
  ASSERT_TRUE(RunUntil([&] { return launcher_.ranks().size() == 2; }, absl::Minutes(1)));
  const std::shared_ptr<FakeRank> silent = launcher_.ranks()[0];
  const std::shared_ptr<FakeRank> alive = launcher_.ranks()[1];
  ASSERT_EQ(silent->rank(), 0);
  int64_t step = 0;
  // Rank 1 heartbeats every step; rank 0 never does.
  ASSERT_TRUE(RunUntil(
      [&] {
        SendHeartbeat(1, ++step);
        return clock_.Now() >= silent->launched() + kHang - kStep;
      },
      absl::Minutes(2)));
  EXPECT_FALSE(Ended()) << coordinator_->last_status().ShortDebugString();
  EXPECT_THAT(What(silent->events()), IsEmpty()) << "condemned before its hang timeout";

  ASSERT_TRUE(RunUntil(
      [&] {
        SendHeartbeat(1, ++step);
        return Ended();
      },
      absl::Minutes(1)));
  const v1::TaskStatus status = coordinator_->last_status();
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  EXPECT_EQ(status.failure().rank(), 0);
  EXPECT_THAT(status.failure().message(), HasSubstr("rank 0 on n1 hung: no heartbeat for"));
  EXPECT_THAT(status.failure().message(), HasSubstr("log of fake rank 0"));
  const absl::Duration silence = FromTimestamp(status.failure().time()) - silent->launched();
  EXPECT_GE(silence, kHang);
  EXPECT_LE(silence, kHang + 3 * kStep);
  EXPECT_THAT(What(silent->events()), ElementsAre("SIGKILL"));
  EXPECT_THAT(What(alive->events()), ElementsAre("SIGTERM"));
  EXPECT_EQ(alive->stop_grace(), options.stop_grace);
}

// A stop order: SIGTERM, and SIGKILL after the stop grace for a rank that ignores it; the end
// goes out only once that rank is gone.
TEST_F(WorkerAgentSimTest, AStopOrderKillsARankThatIgnoresSigtermAfterTheGrace) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(30);
  launcher_.Behave(0, {.ignore_sigterm = true});
  Start(TwoRanks(0), options);
  ASSERT_TRUE(RunUntil([&] { return Running(); }, absl::Minutes(1)));
  coordinator_->OnHeartbeat(
      [](const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response) {
        if (StateIn(request, kTaskId) == v1::TASK_STATE_RUNNING) response->add_stop(kTaskId);
      });
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, absl::Minutes(5)));
  EXPECT_EQ(coordinator_->last_status().state(), v1::TASK_STATE_STOPPED);

  const std::shared_ptr<FakeRank> stubborn = launcher_.ranks()[0];
  const std::vector<Event> events = stubborn->events();
  ASSERT_THAT(What(events), ElementsAre("SIGTERM", "SIGKILL"));
  EXPECT_EQ(stubborn->stop_grace(), options.stop_grace);
  EXPECT_GE(events[1].at - events[0].at, options.stop_grace);
  EXPECT_LE(events[1].at - events[0].at, options.stop_grace + 2 * kStep);
  EXPECT_THAT(What(launcher_.ranks()[1]->events()), ElementsAre("SIGTERM"));
  // Heartbeats said RUNNING through the grace: the end waited for the SIGKILL.
  const absl::Time killed = events[1].at;
  EXPECT_GE(EndArrival(), killed);
  for (const FakeCoordinator::Exchange& exchange : coordinator_->heartbeats()) {
    if (exchange.at >= killed) break;
    EXPECT_FALSE(IsTerminal(StateIn(exchange.request, kTaskId))) << "at " << exchange.at;
  }
}

class PeerFailureSimTest : public WorkerAgentSimTest {
 protected:
  static constexpr absl::Duration kPeerGrace = absl::Seconds(5);

  // Starts two ranks; rank 0 reports a lost peer, which the coordinator receives, then exits 1.
  // Returns when it exited.
  absl::Time StartAndFailRank0WithALostPeer() {
    WorkerAgentOptions options;
    options.peer_failure_grace = kPeerGrace;
    Start(TwoRanks(/*hang_timeout_seconds=*/3600), options);
    EXPECT_TRUE(RunUntil([&] { return Running(); }, absl::Minutes(1)));
    v1::TrainerReport report;
    report.mutable_failure()->set_kind(v1::FAILURE_KIND_PEER_FAILED);
    report.mutable_failure()->set_message("lost rank 1");
    SendReport(0, std::move(report));
    // Relayed, so read: the verdict sees the typed failure, not only the exit code.
    EXPECT_TRUE(RunUntil(
        [&] {
          for (const v1::TrainerReport& relayed : coordinator_->relayed()) {
            if (relayed.has_failure()) return true;
          }
          return false;
        },
        absl::Minutes(1)));
    launcher_.ranks()[0]->Exit(1);
    return clock_.Now();
  }
};

// A rank that lost its peer fails first; the task waits (on simulated time) for the cause.
TEST_F(PeerFailureSimTest, TheCauseThatFailsWithinTheGraceIsBlamed) {
  const absl::Time lost = StartAndFailRank0WithALostPeer();
  ASSERT_FALSE(RunUntil([&] { return Ended(); }, kPeerGrace - 2 * kStep));
  launcher_.ranks()[1]->Exit(3);
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, absl::Minutes(1)));
  const v1::TaskStatus status = coordinator_->last_status();
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().rank(), 1);
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_PROCESS_EXIT);
  EXPECT_THAT(status.failure().message(), HasSubstr("exited with code 3"));
  // Rank 1 never reported: its bare exit status waits kExitReportGrace for a report first.
  EXPECT_GE(EndArrival() - lost, kPeerGrace - 2 * kStep + kExitReportGrace);
}

// No cause within the grace: the lost peer is blamed after all, and the other rank is stopped.
TEST_F(PeerFailureSimTest, WithoutACauseTheLostPeerIsBlamedAfterTheGrace) {
  const absl::Time lost = StartAndFailRank0WithALostPeer();
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, absl::Minutes(1)));
  const v1::TaskStatus status = coordinator_->last_status();
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().rank(), 0);
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_PEER_FAILED);
  EXPECT_GE(EndArrival() - lost, kPeerGrace);
  EXPECT_LE(EndArrival() - lost, kPeerGrace + 3 * kStep);
  EXPECT_THAT(What(launcher_.ranks()[1]->events()), ElementsAre("SIGTERM"));
}

class CheckpointSimTest : public WorkerAgentSimTest {
 protected:
  static constexpr absl::Duration kCheckpointGrace = absl::Minutes(10);

  // Starts two ranks that have reported (a rank is signalled only then), then has the
  // coordinator ask for a checkpoint and a stop; returns when it asked.
  absl::Time StartAndAskForACheckpoint(std::optional<absl::Duration> deadline = std::nullopt) {
    WorkerAgentOptions options;
    options.stop_grace = absl::Seconds(30);
    options.checkpoint_grace = kCheckpointGrace;
    Start(TwoRanks(/*hang_timeout_seconds=*/3600), options);
    EXPECT_TRUE(RunUntil([&] { return Running(); }, absl::Minutes(1)));
    SendHeartbeat(0, 1);
    SendHeartbeat(1, 1);
    EXPECT_TRUE(RunUntil([&] { return BothRanksHeard(); }, absl::Minutes(1)));
    const absl::Time asked = clock_.Now();
    coordinator_->OnHeartbeat(
        [deadline](const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response) {
          if (StateIn(request, kTaskId) == v1::TASK_STATE_RUNNING) {
            response->add_checkpoint_and_stop(kTaskId);
            if (deadline) {
              (*response->mutable_checkpoint_deadline_seconds())[kTaskId] =
                  absl::ToDoubleSeconds(*deadline);
            }
          }
        });
    return asked;
  }

  const std::string checkpoint_signal_ = absl::StrCat("signal ", kCheckpointAndStopSignal);
};

// Ranks that ignore the checkpoint signal keep running for the whole checkpoint grace, then are
// stopped as for a plain stop order.
TEST_F(CheckpointSimTest, RanksThatDoNotSaveAreStoppedAfterTheCheckpointGrace) {
  StartAndAskForACheckpoint();
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, 2 * kCheckpointGrace));
  EXPECT_EQ(coordinator_->last_status().state(), v1::TASK_STATE_STOPPED);
  for (const auto& rank : launcher_.ranks()) {
    const std::vector<Event> events = rank->events();
    ASSERT_THAT(What(events), ElementsAre(checkpoint_signal_, "SIGTERM"))
        << "rank " << rank->rank();
    EXPECT_GE(events[1].at - events[0].at, kCheckpointGrace);
    EXPECT_LE(events[1].at - events[0].at, kCheckpointGrace + 2 * kStep);
  }
}

// A deadline the coordinator sets (a preemption's) replaces the worker's checkpoint grace.
TEST_F(CheckpointSimTest, TheCoordinatorsDeadlineReplacesTheCheckpointGrace) {
  constexpr absl::Duration kDeadline = absl::Minutes(2);
  StartAndAskForACheckpoint(kDeadline);
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, 2 * kCheckpointGrace));
  EXPECT_EQ(coordinator_->last_status().state(), v1::TASK_STATE_STOPPED);
  for (const auto& rank : launcher_.ranks()) {
    const std::vector<Event> events = rank->events();
    ASSERT_THAT(What(events), ElementsAre(checkpoint_signal_, "SIGTERM"))
        << "rank " << rank->rank();
    EXPECT_GE(events[1].at - events[0].at, kDeadline);
    EXPECT_LE(events[1].at - events[0].at, kDeadline + 2 * kStep);
  }
}

// Ranks that save and exit end the task STOPPED at once, never sent a SIGTERM.
TEST_F(CheckpointSimTest, RanksThatSaveEndTheTaskWithoutASigterm) {
  launcher_.Behave(0, {.exit_on_checkpoint = true});
  launcher_.Behave(1, {.exit_on_checkpoint = true});
  const absl::Time asked = StartAndAskForACheckpoint();
  ASSERT_TRUE(RunUntil([&] { return Ended(); }, 2 * kCheckpointGrace));
  EXPECT_EQ(coordinator_->last_status().state(), v1::TASK_STATE_STOPPED);
  for (const auto& rank : launcher_.ranks()) {
    EXPECT_THAT(What(rank->events()), ElementsAre(checkpoint_signal_)) << "rank " << rank->rank();
  }
  // The next heartbeat carried the order (kHeartbeatSeconds); the end followed within steps.
  EXPECT_LE(EndArrival() - asked, absl::Seconds(kHeartbeatSeconds) + 3 * kStep);
}

}  // namespace
}  // namespace tessera::worker
