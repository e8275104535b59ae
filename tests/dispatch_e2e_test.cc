// Sub-second dispatch on the real binaries: a coordinator whose workers heartbeat only once a
// minute, a worker running fake trainers, jobs submitted through the CLI. A trainer can start
// only from a heartbeat response, and the next periodic heartbeat is a minute away, so a trainer
// that starts well within that minute proves the WatchAssignments notice woke the worker. The
// same holds for stop orders (cancel), after a worker restart and after a coordinator restart
// (the stream reconnects), and the coordinator still stops at once on SIGTERM with the stream
// open. Many streams at once (open, cancelled, refused, ended by the shutdown) are checked on a
// bare client.

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/util/http_get.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::HttpGet;
using ::tessera::testing::IsOk;
using ::tessera::testing::RunCommand;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

// The workers' heartbeat period: nothing in this test may wait for it.
constexpr absl::Duration kHeartbeatInterval = absl::Seconds(60);
// How long an early heartbeat may take on a loaded machine; far below kHeartbeatInterval.
constexpr absl::Duration kPrompt = absl::Seconds(20);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Polls `done` every 50 ms until it holds or `deadline` passes.
bool WaitUntil(absl::Time deadline, const std::function<bool()>& done) {
  return testing::WaitUntil(done, deadline - absl::Now(), absl::Milliseconds(50));
}

class DispatchTest : public ::testing::Test {
 protected:
  void StartCoordinator(const std::string& listen = "127.0.0.1:0") {
    auto process = Subprocess::Start(
        {BinDir() + "/tessera-coordinator", "--listen=" + listen, "--metrics_listen=127.0.0.1:0",
         "--state=" + dir_.path() + "/state.db",
         "--checkpoint_root=" + dir_.path() + "/checkpoints",
         absl::StrCat("--heartbeat_interval=", absl::FormatDuration(kHeartbeatInterval)),
         absl::StrCat("--heartbeat_timeout=", absl::FormatDuration(3 * kHeartbeatInterval))});
    ASSERT_THAT(process, IsOk());
    auto line = process->WaitForStderrLine("serving gRPC on");
    ASSERT_THAT(line, IsOk()) << process->stderr_text();
    std::smatch match;
    const std::string serving = *line;
    ASSERT_TRUE(std::regex_search(
        serving, match, std::regex(R"(serving gRPC on (\S+:\d+), metrics on port (\d+))")))
        << serving;
    address_ = match[1];
    ASSERT_TRUE(absl::SimpleAtoi(match[2].str(), &metrics_port_));
    coordinator_.emplace(std::move(*process));
  }

  // Starts the worker and waits until its watch stream is open; returns when it registered.
  absl::Time StartWorker() {
    testing::SubprocessOptions options;
    options.extra_env = {"TESSERA_FAKE_TRAINER_ARGS_RANK0=--sleep=600",
                         "TESSERA_FAKE_TRAINER_ARGS_RANK1=--sleep=600"};
    auto process = Subprocess::Start(
        {BinDir() + "/tessera-worker", "--coordinator=" + address_, "--node_name=cpu-1",
         "--listen=127.0.0.1:0", "--metrics_listen=", "--cpu_slots=2", "--work_dir=" + work_dir(),
         "--trainer=" + BinDir() + "/../tests/fake_trainer"},
        options);
    EXPECT_THAT(process, IsOk());
    if (!process.ok()) return absl::InfinitePast();
    worker_.emplace(std::move(*process));
    EXPECT_THAT(worker_->WaitForStderrLine("registered with"), IsOk()) << worker_->stderr_text();
    const absl::Time registered = absl::Now();
    EXPECT_THAT(worker_->WaitForStderrLine("watching the coordinator for assignments"), IsOk())
        << worker_->stderr_text();
    return registered;
  }

  std::string work_dir() const { return dir_.path() + "/work"; }

  std::string Cli(const std::string& args) {
    auto result = RunCommand({"/bin/sh", "-c",
                              "TESSERA_DATA_DIR=" + dir_.path() + " " + BinDir() +
                                  "/tessera --coordinator=" + address_ + " " + args});
    EXPECT_THAT(result, IsOk());
    if (!result.ok()) return "";
    EXPECT_EQ(result->exit.exit_code, 0) << args << ": " << result->output;
    return result->output;
  }

  std::string Submit() {
    const std::string output =
        Cli(std::string("submit ") + TESSERA_EXAMPLES_DIR + "/tiny-gpt.yaml");
    return output.substr(0, output.find('\n'));
  }

  // Whether rank 0 of the job's first attempt has started (the fake trainer prints READY).
  bool TrainerStarted(const std::string& job_id) {
    return ReadFile(work_dir() + "/jobs/" + job_id + "/attempt-0/rank-0.log").find("READY") !=
           std::string::npos;
  }

  // Trainers the worker runs now (one pid file each).
  int RunningTrainers() {
    std::error_code error;
    std::filesystem::directory_iterator files(work_dir() + "/trainers", error);
    return error ? 0 : static_cast<int>(std::distance(files, std::filesystem::directory_iterator()));
  }

  // OK heartbeats the coordinator answered, from its /metrics; -1 when it cannot be read.
  int Heartbeats() {
    auto metrics = HttpGet(metrics_port_, "/metrics");
    if (!metrics.ok()) return -1;
    std::smatch match;
    static const std::regex kLine(
        R"re(tessera_grpc_server_requests_total\{code="OK",method="/tessera.v1.NodeService/Heartbeat"\} (\d+))re");
    int count = 0;
    if (!std::regex_search(metrics->body, match, kLine)) return 0;
    return absl::SimpleAtoi(match[1].str(), &count) ? count : -1;
  }

  ScopedTempDir dir_{"dispatch_e2e_test"};
  std::optional<Subprocess> coordinator_;
  std::optional<Subprocess> worker_;
  std::string address_;
  int metrics_port_ = 0;
};

TEST_F(DispatchTest, AssignmentsReachTheWorkerLongBeforeItsNextHeartbeat) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  const absl::Time registered = StartWorker();
  const absl::Time next_heartbeat = registered + kHeartbeatInterval;

  const std::string job_id = Submit();
  ASSERT_FALSE(job_id.empty());
  ASSERT_TRUE(WaitUntil(registered + kPrompt, [&] { return TrainerStarted(job_id); }))
      << Cli("get " + job_id) << worker_->stderr_text();
  EXPECT_LT(absl::Now(), next_heartbeat);
  EXPECT_THAT(Cli("get " + job_id), HasSubstr("SCHEDULED"));

  // Notices lead to heartbeats, not to a storm of them: registration, the stream's opening notice
  // and the placement make three at most, and a running job adds none. A check that something
  // does not happen: the second is the time it is given to happen (a fourth ends the wait early).
  EXPECT_FALSE(WaitUntil(absl::Now() + absl::Seconds(1), [&] { return Heartbeats() > 3; }));
  const int heartbeats = Heartbeats();
  EXPECT_GE(heartbeats, 2);
  EXPECT_LE(heartbeats, 3);

  // Cancelling sends a stop order the same way: the trainers end long before the next heartbeat.
  ASSERT_EQ(RunningTrainers(), 2);
  Cli("cancel " + job_id);
  EXPECT_TRUE(WaitUntil(absl::Now() + kPrompt, [&] { return RunningTrainers() == 0; }))
      << worker_->stderr_text();
  EXPECT_LT(absl::Now(), next_heartbeat);

  // SIGTERM is obeyed at once with the worker's stream open.
  const absl::Time signalled = absl::Now();
  auto exit = coordinator_->Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0) << coordinator_->stderr_text();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(3)) << "the watch stream held the shutdown";
  coordinator_.reset();
  auto worker_exit = worker_->Stop(SIGTERM);
  ASSERT_THAT(worker_exit, IsOk());
  EXPECT_EQ(worker_exit->exit_code, 0) << worker_->stderr_text();
}

TEST_F(DispatchTest, TheStreamComesBackAfterAWorkerAndACoordinatorRestart) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  StartWorker();

  // A restarted worker (same node, same work directory) watches again.
  ASSERT_THAT(worker_->Stop(SIGTERM), IsOk());
  worker_.reset();
  absl::Time registered = StartWorker();
  const std::string first = Submit();
  ASSERT_TRUE(WaitUntil(registered + kPrompt, [&] { return TrainerStarted(first); }))
      << Cli("get " + first) << worker_->stderr_text();
  Cli("cancel " + first);
  ASSERT_TRUE(WaitUntil(absl::Now() + kPrompt, [&] { return RunningTrainers() == 0; }));

  // The coordinator restarts on the same address: the worker's stream ends (UNAVAILABLE), the
  // worker registers again and reopens it, and the next job starts at once.
  const std::string address = address_;
  ASSERT_THAT(coordinator_->Stop(SIGTERM), IsOk());
  coordinator_.reset();
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(address));
  ASSERT_THAT(worker_->WaitForStderrLine("watching the coordinator for assignments"), IsOk())
      << worker_->stderr_text();
  registered = absl::Now();
  const std::string second = Submit();
  ASSERT_TRUE(WaitUntil(registered + kPrompt, [&] { return TrainerStarted(second); }))
      << Cli("get " + second) << worker_->stderr_text();
}

// The coordinator serves WatchAssignments streams on completion queues of their own: many at
// once each get their opening notice, a watcher that goes away is let go while the rest stay open
// and heartbeats are answered, and on SIGTERM every open stream ends with UNAVAILABLE at once.
TEST_F(DispatchTest, ManyStreamsOpenEndAndCloseWithTheCoordinator) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  auto nodes = v1::NodeService::NewStub(MakeClientChannel(address_));
  v1::RegisterNodeRequest registration;
  registration.set_node_id("watch-1");
  registration.set_hostname("watch-1");
  registration.set_address("127.0.0.1:1");
  registration.set_node_key("key-1");
  registration.mutable_resources()->set_cpu_slots(1);
  v1::RegisterNodeResponse registered;
  grpc::ClientContext register_context;
  ASSERT_TRUE(nodes->RegisterNode(&register_context, registration, &registered).ok());
  constexpr int kStreams = 64;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::AssignmentsNotice>>> streams;
  v1::WatchAssignmentsRequest watch;
  watch.set_node_id("watch-1");
  watch.set_node_key("key-1");
  for (int i = 0; i < kStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    streams.push_back(nodes->WatchAssignments(contexts.back().get(), watch));
  }
  v1::AssignmentsNotice notice;
  for (int i = 0; i < kStreams; ++i) ASSERT_TRUE(streams[i]->Read(&notice)) << "stream " << i;
  // Half the watchers go away.
  for (int i = 0; i < kStreams / 2; ++i) {
    contexts[i]->TryCancel();
    EXPECT_EQ(streams[i]->Finish().error_code(), grpc::StatusCode::CANCELLED) << "stream " << i;
  }
  // A wrong key is refused on the stream itself.
  grpc::ClientContext refused_context;
  v1::WatchAssignmentsRequest wrong = watch;
  wrong.set_node_key("key-2");
  auto refused = nodes->WatchAssignments(&refused_context, wrong);
  EXPECT_FALSE(refused->Read(&notice));
  EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("watch-1");
  heartbeat.set_node_key("key-1");
  v1::HeartbeatResponse beat;
  grpc::ClientContext beat_context;
  EXPECT_TRUE(nodes->Heartbeat(&beat_context, heartbeat, &beat).ok());

  // The rest are read to their end, as workers read them.
  std::vector<grpc::Status> ends(kStreams);
  std::vector<std::thread> readers;
  for (int i = kStreams / 2; i < kStreams; ++i) {
    readers.emplace_back([&, i] {
      v1::AssignmentsNotice more;
      while (streams[i]->Read(&more)) {
      }
      ends[i] = streams[i]->Finish();
    });
  }
  const absl::Time signalled = absl::Now();
  auto exit = coordinator_->Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0) << coordinator_->stderr_text();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(3)) << "open streams held the shutdown";
  coordinator_.reset();
  for (auto& reader : readers) reader.join();
  for (int i = kStreams / 2; i < kStreams; ++i) {
    EXPECT_EQ(ends[i].error_code(), grpc::StatusCode::UNAVAILABLE) << "stream " << i;
    EXPECT_THAT(ends[i].error_message(), HasSubstr("shutting down")) << "stream " << i;
  }
}

}  // namespace
}  // namespace tessera
