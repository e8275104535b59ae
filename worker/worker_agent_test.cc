// WorkerAgent against an in-process fake coordinator (NodeService on 127.0.0.1, port 0) and
// tests/fake_trainer ranks that speak the report socket: which failure a task blames, the hang
// watchdog, stop orders after a failure, and that heartbeats are consumed, not relayed. The
// end-to-end check of the agent with real processes and the real clock; worker_agent_sim_test.cc
// drives the same lifecycle in-process on simulated time.
#include "worker/worker_agent.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"
#include "worker/coordinator_fake.h"
#include "worker/worker_service.h"

namespace tessera::worker {
namespace {

using agent_test::FakeCoordinator;
using agent_test::GpuRanks;
using agent_test::IsTerminal;
using agent_test::ServeOnLoopback;
using agent_test::kTaskId;
using agent_test::StateIn;
using agent_test::TwoRanks;
using ::tessera::testing::IsOk;
using ::testing::HasSubstr;

constexpr char kFakeTrainer[] = TESSERA_FAKE_TRAINER;
class WorkerAgentTest : public ::testing::Test {
 protected:
  void StartCluster(v1::TaskAssignment assignment, const std::string& rank0_flags,
                    const std::string& rank1_flags, WorkerAgentOptions options,
                    std::unique_ptr<GpuBackend> gpus = nullptr) {
    setenv("TESSERA_FAKE_TRAINER_ARGS_RANK0", rank0_flags.c_str(), 1);
    setenv("TESSERA_FAKE_TRAINER_ARGS_RANK1", rank1_flags.c_str(), 1);
    coordinator_ = std::make_unique<FakeCoordinator>(std::move(assignment));
    coordinator_->set_trainers_dir(work_dir_ + "/trainers");
    server_ = ServeOnLoopback(coordinator_.get(), &options.coordinator_address);
    ASSERT_NE(server_, nullptr);
    options.node_id = "n1";
    options.work_dir = work_dir_;
    options.cpu_slots = 2;
    options.trainer_path = kFakeTrainer;
    options.poll_interval = absl::Milliseconds(50);
    options.trainer_heartbeat_interval = absl::Milliseconds(100);
    agent_ = std::make_unique<WorkerAgent>(options, std::move(gpus));
    ASSERT_THAT(agent_->Start("127.0.0.1:1"), IsOk());
  }

  void TearDown() override {
    if (agent_) agent_->Stop();
    if (server_) server_->Shutdown();
    unsetenv("TESSERA_FAKE_TRAINER_ARGS_RANK0");
    unsetenv("TESSERA_FAKE_TRAINER_ARGS_RANK1");
  }

  void ExpectNoHeartbeatRelayed() {
    for (const v1::TrainerReport& report : coordinator_->relayed()) {
      EXPECT_FALSE(report.has_heartbeat()) << "relayed: " << report.ShortDebugString();
    }
  }

  const std::string work_dir_ = ::tessera::testing::TestDir() + "/w";
  std::unique_ptr<FakeCoordinator> coordinator_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<WorkerAgent> agent_;
};

TEST(TrainerThreadsTest, CoresAreSharedAmongSlotsUnlessAskedFor) {
  EXPECT_EQ(TrainerThreads(0, 16, 2), 8);
  EXPECT_EQ(TrainerThreads(0, 2, 2), 1);
  EXPECT_EQ(TrainerThreads(0, 2, 4), 1) << "never 0 threads";
  EXPECT_EQ(TrainerThreads(0, 8, 0), 8) << "no slots counted: one rank's share is every core";
  EXPECT_EQ(TrainerThreads(3, 16, 2), 3);
}

TEST_F(WorkerAgentTest, BlamesTheCauseNotTheRankThatLostItsPeerFirst) {
  WorkerAgentOptions options;
  options.peer_failure_grace = absl::Seconds(5);
  options.trainer_threads = 3;
  // Rank 0 reports a lost peer at once; rank 1, the cause, exits 0.4 s later with no report.
  StartCluster(TwoRanks(0), "--heartbeat --report_failure=10 --exit=1",
               "--heartbeat --sleep=0.4 --exit=3", options);
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(30));
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().rank(), 1);
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_PROCESS_EXIT);
  EXPECT_EQ(status.failure().exit_code(), 3);
  EXPECT_THAT(status.failure().message(), HasSubstr("exited with code 3"));
  EXPECT_EQ(status.failure().node_id(), "n1");
  EXPECT_GT(status.failure().time().seconds(), 0);
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "a rank was alive when the end went out";

  // The worker passed its pid, and kept the ranks' heartbeats to itself.
  std::ifstream log(work_dir_ + "/jobs/job-1/attempt-0/rank-0.log");
  std::stringstream text;
  text << log.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr(absl::StrCat("TESSERA_WORKER_PID=", getpid(), "\n")));
  // Its share of the cores, whatever the worker's own environment says.
  EXPECT_THAT(text.str(), HasSubstr("OMP_NUM_THREADS=3\n"));
  EXPECT_THAT(text.str(), HasSubstr("MKL_NUM_THREADS=3\n"));
  ExpectNoHeartbeatRelayed();
  bool relayed_peer_failure = false;
  for (const v1::TrainerReport& report : coordinator_->relayed()) {
    relayed_peer_failure |= report.failure().kind() == v1::FAILURE_KIND_PEER_FAILED;
  }
  EXPECT_TRUE(relayed_peer_failure) << "typed failure reports are still relayed";
}

TEST_F(WorkerAgentTest, HungRankIsKilledAndBlamed) {
  WorkerAgentOptions options;
  // A SIGTERM-and-wait stop would take this long: the hung rank must be SIGKILLed instead.
  options.stop_grace = absl::Seconds(20);
  StartCluster(TwoRanks(/*hang_timeout_seconds=*/1),
               "--heartbeat --stop_after_heartbeats=3 --sleep=60", "--heartbeat --sleep=60",
               options);
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(30));
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_COLLECTIVE_TIMEOUT);
  EXPECT_EQ(status.failure().rank(), 0);
  EXPECT_THAT(status.failure().message(), HasSubstr("rank 0 on n1 hung: no heartbeat for"));
  EXPECT_THAT(status.failure().message(), HasSubstr("(process state: stopped)"));
  EXPECT_GT(status.failure().time().seconds(), 0);
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "the ranks were not reaped by the end";

  // Step times reached the coordinator in the node heartbeat, and only there.
  bool rank1_progress = false;
  for (const v1::RankStepTime& step_time : coordinator_->step_times()) {
    EXPECT_EQ(step_time.node_id(), "n1");
    EXPECT_GT(step_time.heartbeat_time().seconds(), 0);
    rank1_progress |= step_time.rank() == 1 && step_time.step() > 0;
    // The heartbeat's breakdown rides along (fake_trainer sends forward_seconds 0.25).
    EXPECT_DOUBLE_EQ(step_time.breakdown().forward_seconds(), 0.25);
  }
  EXPECT_TRUE(rank1_progress);
  ExpectNoHeartbeatRelayed();
}

TEST_F(WorkerAgentTest, StopOrderAfterARankFailedOnItsOwnFails) {
  WorkerAgentOptions options;
  options.peer_failure_grace = absl::Seconds(60);  // the verdict waits for the stop order
  options.stop_grace = absl::Seconds(2);
  StartCluster(TwoRanks(0), "--heartbeat --report_failure=10 --exit=1", "--heartbeat --sleep=60",
               options);
  coordinator_->StopOnFailureReport();
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(30));
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().rank(), 0);
  EXPECT_EQ(status.failure().kind(), v1::FAILURE_KIND_PEER_FAILED);
  EXPECT_EQ(status.failure().exit_code(), 1);
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "a rank was alive when the end went out";
}

TEST_F(WorkerAgentTest, AFailedTaskEndsOnlyOnceEveryRankHasExited) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(2);
  // Rank 1 fails; rank 0 ignores the SIGTERM that stops it, so only the SIGKILL after the stop
  // grace ends it. Until then the task holds its slots and rank 0 its master port: the end must
  // not reach the coordinator, which would place a restart on them.
  StartCluster(TwoRanks(0), "--heartbeat --ignore_sigterm --sleep=60",
               "--heartbeat --sleep=0.3 --exit=3", options);
  const absl::Time started = absl::Now();
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(30));
  ASSERT_EQ(status.state(), v1::TASK_STATE_FAILED) << status.ShortDebugString();
  EXPECT_EQ(status.failure().rank(), 1);
  EXPECT_EQ(status.failure().exit_code(), 3);
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "a rank was alive when the end went out";
  EXPECT_GE(absl::Now() - started, options.stop_grace) << "the end came before the SIGKILL";
}

// A coordinator that restarted while an attempt was ending may start the next attempt on the same
// GPUs, port and node in the answer that stops the old one. The new ranks wait for the old ones
// to exit (two trainers on a GPU could both run out of its memory; two rendezvous cannot share a
// port), and so does any task wanting a GPU of a task being stopped; a task on other GPUs starts at
// once, and one sharing a GPU with a task the coordinator still wants is not held back.
TEST_F(WorkerAgentTest, ANewTaskWaitsForTheStoppingRanksOnItsGpusAndNoOther) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(1);
  // Rank 0 of every task ignores SIGTERM: a stopped task's rank 0 lives until the SIGKILL.
  StartCluster(GpuRanks("job-1", 0, 0, 29500), "--heartbeat --ignore_sigterm --sleep=60",
               "--heartbeat --sleep=60", options);
  const std::string old_task = "job-1/0/n1", next_attempt = "job-1/1/n1", other_gpus = "job-2/0/n1",
                    shared_gpu = "job-3/0/n1";
  coordinator_->OnHeartbeat([&, ordered = false](const v1::HeartbeatRequest& request,
                                                 v1::HeartbeatResponse* response) mutable {
    // Once rank 0 has heartbeated: it ignores SIGTERM from before its first heartbeat.
    bool settled = false;
    for (const v1::TaskStatus& status : request.tasks()) {
      if (status.task_id() != old_task) continue;
      for (const v1::RankStepTime& rank : status.ranks()) {
        settled |= rank.rank() == 0 && rank.has_heartbeat_time();
      }
    }
    if (ordered || !settled) return;
    ordered = true;
    response->add_stop(old_task);
    *response->add_start() = GpuRanks("job-1", 1, 0, 29500);
    *response->add_start() = GpuRanks("job-2", 0, 2, 29501);
    // GPU 1 is the stopping task's, GPU 2 job-2's.
    *response->add_start() = GpuRanks("job-3", 0, 1, 29502);
  });
  const auto heartbeats = coordinator_->WaitForHeartbeats(
      [&](const std::vector<FakeCoordinator::Exchange>& so_far) {
        return !so_far.empty() &&
               StateIn(so_far.back().request, next_attempt) == v1::TASK_STATE_RUNNING &&
               StateIn(so_far.back().request, shared_gpu) == v1::TASK_STATE_RUNNING;
      },
      absl::Seconds(30));
  // Heartbeat indices: the answer with the orders, and the first to report each state.
  auto first = [&](size_t from, const std::string& task_id, auto predicate) {
    for (size_t i = from; i < heartbeats.size(); ++i) {
      if (predicate(StateIn(heartbeats[i].request, task_id))) return i;
    }
    return heartbeats.size();
  };
  size_t order = heartbeats.size();
  for (size_t i = 0; i < heartbeats.size(); ++i) {
    if (heartbeats[i].response.stop_size() > 0) order = std::min(order, i);
  }
  ASSERT_LT(order, heartbeats.size()) << "the old task never ran";
  auto running = [](v1::TaskState state) { return state == v1::TASK_STATE_RUNNING; };
  const size_t old_ended = first(order + 1, old_task, [](v1::TaskState state) {
    return IsTerminal(state) || state == v1::TASK_STATE_UNSPECIFIED;
  });
  const size_t next_ran = first(order + 1, next_attempt, running);
  const size_t shared_ran = first(order + 1, shared_gpu, running);
  const size_t other_ran = first(order + 1, other_gpus, running);
  ASSERT_LT(next_ran, heartbeats.size()) << "the next attempt never ran";
  ASSERT_LT(shared_ran, heartbeats.size());
  EXPECT_EQ(other_ran, order + 1) << "a task on other GPUs waited";
  EXPECT_LE(old_ended, next_ran) << "the next attempt ran beside the old one";
  EXPECT_LE(old_ended, shared_ran) << "a task shared a GPU with a stopping one";
  // The old rank 0 lived until the SIGKILL: the next attempt said STARTING meanwhile.
  EXPECT_GT(next_ran, order + 5);
  for (size_t i = order + 1; i < next_ran; ++i) {
    EXPECT_EQ(StateIn(heartbeats[i].request, next_attempt), v1::TASK_STATE_STARTING) << i;
  }
  // Each rank of the next attempt sees only its own GPU: it prints its environment before its
  // first heartbeat, which the worker passes on in its own.
  coordinator_->WaitForHeartbeats(
      [&](const std::vector<FakeCoordinator::Exchange>& so_far) {
        if (so_far.empty()) return false;
        int heard = 0;
        for (const v1::TaskStatus& status : so_far.back().request.tasks()) {
          if (status.task_id() != next_attempt) continue;
          for (const v1::RankStepTime& rank : status.ranks()) heard += rank.has_heartbeat_time();
        }
        return heard == 2;
      },
      absl::Seconds(10));
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream log(absl::StrCat(work_dir_, "/jobs/job-1/attempt-1/rank-", rank, ".log"));
    std::stringstream text;
    text << log.rdbuf();
    EXPECT_THAT(text.str(), HasSubstr(absl::StrCat("CUDA_VISIBLE_DEVICES=", rank, "\n")));
  }
}

// The node's place in the network (--topology) goes out with its registration.
TEST_F(WorkerAgentTest, TheRegistrationCarriesTheNodesTopology) {
  WorkerAgentOptions options;
  options.topology = {{"rack", "r17"}, {"block", "b3"}};
  StartCluster(TwoRanks(0), "--sleep=60", "--sleep=60", options);
  ASSERT_TRUE(::tessera::testing::WaitUntil([&] { return !coordinator_->registrations().empty(); },
                                            absl::Seconds(30)));
  const v1::RegisterNodeRequest registration = coordinator_->registrations().front();
  ASSERT_EQ(registration.topology_size(), 2);
  EXPECT_EQ(registration.topology().at("rack"), "r17");
  EXPECT_EQ(registration.topology().at("block"), "b3");
}

// Each rank's step time breakdown reaches the coordinator in the worker's heartbeat, while the
// per-step rank reports stay on the worker (for its metrics), as heartbeats do.
TEST_F(WorkerAgentTest, RankBreakdownsGoOutInHeartbeatsAndRankStepsAreNotRelayed) {
  StartCluster(TwoRanks(0), "--heartbeat --rank_steps --sleep=60",
               "--heartbeat --rank_steps --sleep=60", WorkerAgentOptions());
  const auto heartbeats = coordinator_->WaitForHeartbeats(
      [](const std::vector<FakeCoordinator::Exchange>& so_far) {
        if (so_far.empty()) return false;
        int with_breakdown = 0;
        for (const v1::TaskStatus& status : so_far.back().request.tasks()) {
          for (const v1::RankStepTime& rank : status.ranks()) {
            with_breakdown += rank.breakdown().forward_seconds() == 0.25 &&
                              rank.breakdown().collectives_size() == 1 &&
                              rank.breakdown().collectives(0).kind() == "all_reduce";
          }
        }
        return with_breakdown == 2;
      },
      absl::Seconds(30));
  ASSERT_FALSE(heartbeats.empty());
  int with_breakdown = 0;
  for (const v1::TaskStatus& status : heartbeats.back().request.tasks()) {
    for (const v1::RankStepTime& rank : status.ranks()) {
      with_breakdown += rank.breakdown().forward_seconds() == 0.25;
    }
  }
  EXPECT_EQ(with_breakdown, 2) << "no heartbeat carried both ranks' breakdowns";
  // Several relay rounds (poll_interval 50 ms) after rank steps arrived: four more heartbeats
  // (0.1 s apart) span at least six of them.
  const size_t seen = heartbeats.size();
  ASSERT_GE(coordinator_
                ->WaitForHeartbeats(
                    [seen](const std::vector<FakeCoordinator::Exchange>& so_far) {
                      return so_far.size() >= seen + 4;
                    },
                    absl::Seconds(30))
                .size(),
            seen + 4);
  for (const v1::TrainerReport& report : coordinator_->relayed()) {
    EXPECT_FALSE(report.has_rank_step()) << "relayed: " << report.ShortDebugString();
  }
  ExpectNoHeartbeatRelayed();
}

// A GPU inventory of fixed devices, sampled as idle.
class FixedGpus final : public GpuBackend {
 public:
  std::vector<v1::GpuDevice> Devices() override {
    std::vector<v1::GpuDevice> devices;
    for (int index = 0; index < 4; ++index) {
      v1::GpuDevice& device = devices.emplace_back();
      device.set_index(index);
      device.set_uuid(absl::StrCat("GPU-fake-", index));
    }
    return devices;
  }
  std::vector<GpuSample> Sample() override { return {}; }
};

// The ranks a running task holds, for TrainingMetrics' tessera_task_gpu_info: the GPU of the
// assignment (not the device 0 the process sees) with the inventory's UUID, until the task ends.
TEST_F(WorkerAgentTest, RunningRanksNameTheirGpusUntilTheTaskEnds) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(1);
  StartCluster(GpuRanks("job-1", 0, 2, 29500), "--heartbeat --sleep=60", "--heartbeat --sleep=60",
               options, std::make_unique<FixedGpus>());
  std::vector<RunningRank> running;
  testing::WaitUntil([&] { return (running = agent_->RunningRanks()).size() >= 2; },
                     absl::Seconds(30), absl::Milliseconds(50));
  ASSERT_EQ(running.size(), 2u);
  std::sort(running.begin(), running.end(),
            [](const RunningRank& a, const RunningRank& b) { return a.rank < b.rank; });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(running[rank].job_id, "job-1");
    EXPECT_EQ(running[rank].rank, rank);
    EXPECT_EQ(running[rank].gpu, 2 + rank);
    EXPECT_EQ(running[rank].gpu_uuid, absl::StrCat("GPU-fake-", 2 + rank));
  }
  agent_->Stop();
  EXPECT_TRUE(agent_->RunningRanks().empty());
}

}  // namespace
}  // namespace tessera::worker

namespace tessera::worker {
namespace {

// The coordinator's checkpoint_and_stop for kTaskId, in every heartbeat once both ranks run.
void AskForACheckpointOnceRunning(FakeCoordinator& coordinator) {
  coordinator.OnHeartbeat([](const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response) {
    if (StateIn(request, kTaskId) == v1::TASK_STATE_RUNNING) {
      response->add_checkpoint_and_stop(kTaskId);
    }
  });
}

std::string RankLog(const std::string& work_dir, int rank) {
  std::ifstream in(absl::StrCat(work_dir, "/jobs/job-1/attempt-0/rank-", rank, ".log"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Asked to checkpoint and stop, the worker signals the ranks instead of SIGTERM and waits while
// they save: ranks that ignore SIGTERM still end at once, on their own, and the task is STOPPED.
TEST_F(WorkerAgentTest, CheckpointAndStopSignalsTheRanksAndWaitsForThemToExit) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(30);  // a SIGTERM would cost the whole grace
  options.checkpoint_grace = absl::Seconds(60);
  const std::string flags = "--heartbeat --ignore_sigterm --checkpoint_on_signal=0.5 --sleep=120";
  StartCluster(TwoRanks(0), flags, flags, options);
  AskForACheckpointOnceRunning(*coordinator_);
  const absl::Time started = absl::Now();
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(20));
  ASSERT_EQ(status.state(), v1::TASK_STATE_STOPPED) << status.ShortDebugString();
  EXPECT_LT(absl::Now() - started, absl::Seconds(15)) << "the ranks were not stopped by the save";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(RankLog(work_dir_, rank), HasSubstr("CHECKPOINTED")) << "rank " << rank;
  }
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "the end went out before the ranks exited";
}

// Ranks that do not answer within the checkpoint grace are stopped as for a plain stop order.
TEST_F(WorkerAgentTest, CheckpointAndStopFallsBackToAStopAfterTheGrace) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(2);
  options.checkpoint_grace = absl::Seconds(1);
  const std::string flags = "--heartbeat --sleep=120";  // the signal is ignored
  StartCluster(TwoRanks(0), flags, flags, options);
  AskForACheckpointOnceRunning(*coordinator_);
  const v1::TaskStatus status = coordinator_->WaitForEnd(absl::Seconds(30));
  ASSERT_EQ(status.state(), v1::TASK_STATE_STOPPED) << status.ShortDebugString();
  EXPECT_EQ(coordinator_->trainers_at_end(), 0) << "a rank was alive when the end went out";
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_THAT(RankLog(work_dir_, rank), ::testing::Not(HasSubstr("CHECKPOINTED")));
  }
}

// tessera.v1.Worker/ReadLogs with follow, served on the callback API: what the ranks wrote comes
// at once, the stream stays open while the task runs, a stream the client cancels ends, and a
// following stream ends OK once the task has ended and its output is sent.
TEST_F(WorkerAgentTest, AFollowingLogStreamEndsWithTheTaskAndACancelledOneAtOnce) {
  WorkerAgentOptions options;
  options.stop_grace = absl::Seconds(1);
  // The ranks print their lines, then run 5 s more and exit: the task ends on its own.
  StartCluster(GpuRanks("job-1", 0, 2, 29500), "--lines=3 --sleep=5", "--lines=3 --sleep=5",
               options, std::make_unique<FixedGpus>());
  ASSERT_TRUE(testing::WaitUntil([&] { return agent_->RunningRanks().size() >= 2; },
                                 absl::Seconds(30), absl::Milliseconds(50)));
  WorkerService service(agent_.get());
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::Worker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  v1::ReadLogsRequest request;
  request.set_job_id("job-1");
  request.set_attempt(0);
  request.set_rank(-1);
  request.set_follow(true);
  // Reads `reader` until every rank's output holds "line 2".
  auto read_all_lines = [](grpc::ClientReader<v1::LogChunk>& reader) {
    std::map<int, std::string> text;
    v1::LogChunk chunk;
    while (reader.Read(&chunk)) {
      text[chunk.rank()] += chunk.data();
      if (text.size() == 2 && absl::StrContains(text[0], "line 2") &&
          absl::StrContains(text[1], "line 2")) {
        return true;
      }
    }
    return false;
  };

  grpc::ClientContext cancelled_context;
  cancelled_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto cancelled = stub->ReadLogs(&cancelled_context, request);
  ASSERT_TRUE(read_all_lines(*cancelled));
  cancelled_context.TryCancel();
  v1::LogChunk chunk;
  while (cancelled->Read(&chunk)) {
  }
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);

  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  auto following = stub->ReadLogs(&context, request);
  ASSERT_TRUE(read_all_lines(*following));
  EXPECT_TRUE(agent_->Running("job-1", 0)) << "the ranks' sleep is over before the test got here";
  while (following->Read(&chunk)) {
  }
  const grpc::Status status = following->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_FALSE(agent_->Running("job-1", 0));
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
}

}  // namespace
}  // namespace tessera::worker
