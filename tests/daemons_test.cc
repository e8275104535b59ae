// Starts the real tessera-coordinator and tessera-worker binaries on
// loopback, talks gRPC to them (through the `tessera` CLI and a stub), scrapes
// their Prometheus endpoints, and stops them with SIGTERM.

#include <signal.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/util/free_port.h"
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

struct Daemon {
  Subprocess process;
  std::string address;
  int metrics_port = 0;
};

// Starts a daemon binary on ephemeral ports and reads the bound ones from
// its "serving gRPC on HOST:PORT[, metrics on port N]" line.
absl::StatusOr<Daemon> StartDaemon(const std::string& binary,
                                   const std::vector<std::string>& extra_flags = {}) {
  std::vector<std::string> argv = {absl::StrCat(BinDir(), "/", binary), "--listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  auto process = Subprocess::Start(argv);
  if (!process.ok()) return process.status();
  auto line = process->WaitForStderrLine("serving gRPC on");
  if (!line.ok()) return line.status();
  std::smatch match;
  static const std::regex kPattern(R"(serving gRPC on (\S+:\d+)(, metrics on port (\d+))?)");
  if (!std::regex_search(*line, match, kPattern)) {
    return absl::InternalError(absl::StrCat("unexpected line: ", *line));
  }
  Daemon daemon{.process = std::move(*process), .address = match[1]};
  if (match[3].matched) (void)absl::SimpleAtoi(match[3].str(), &daemon.metrics_port);
  return daemon;
}

TEST(DaemonsTest, CoordinatorServesHealthMetricsAndTheContract) {
  ScopedTempDir state("daemons_test");
  auto coordinator = StartDaemon("tessera-coordinator", {"--state=" + state.path() + "/db"});
  ASSERT_THAT(coordinator, IsOk());

  // The CLI reaches it over TCP.
  auto health =
      RunCommand({BinDir() + "/tessera", "--coordinator=" + coordinator->address, "health"});
  ASSERT_THAT(health, IsOk());
  EXPECT_EQ(health->exit.exit_code, 0) << health->output;
  EXPECT_THAT(health->output, HasSubstr("SERVING"));

  // Both v1 services are registered and check their input.
  auto stub = v1::Coordinator::NewStub(MakeClientChannel(coordinator->address));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::ListJobsResponse response;
  grpc::Status status = stub->ListJobs(&context, {}, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.jobs_size(), 0);
  auto nodes = v1::NodeService::NewStub(MakeClientChannel(coordinator->address));
  grpc::ClientContext node_context;
  node_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::RegisterNodeResponse registered;
  grpc::Status register_status = nodes->RegisterNode(&node_context, {}, &registered);
  EXPECT_EQ(register_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(register_status.error_message(), HasSubstr("node_id"));

  ASSERT_GT(coordinator->metrics_port, 0);
  // The cluster loop publishes its gauges within a pass (200 ms).
  absl::StatusOr<testing::HttpResponse> metrics;
  testing::WaitUntil(
      [&] {
        metrics = HttpGet(coordinator->metrics_port, "/metrics");
        return !metrics.ok() ||
               absl::StrContains(metrics->body, "tessera_scheduler_pass_duration_seconds_count");
      },
      absl::Seconds(10), absl::Milliseconds(100));
  ASSERT_THAT(metrics, IsOk());
  EXPECT_THAT(metrics->body, HasSubstr("tessera_build_info{component=\"coordinator\""));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_jobs{state=\"pending\"} 0"));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_scheduler_pass_duration_seconds_count"));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_grpc_server_requests_total{code=\"OK\","
                                       "method=\"/tessera.v1.Coordinator/ListJobs\"} 1"));
  EXPECT_THAT(metrics->body,
              HasSubstr("tessera_grpc_server_requests_total{code=\"INVALID_ARGUMENT\","
                        "method=\"/tessera.v1.NodeService/RegisterNode\"} 1"));
  // The exposition passes Prometheus' own linter, where it is installed.
  if (access("/usr/bin/promtool", X_OK) == 0) {
    std::string file = state.path() + "/metrics.txt";
    std::ofstream(file) << metrics->body;
    auto lint = RunCommand({"/bin/sh", "-c", "/usr/bin/promtool check metrics < " + file});
    ASSERT_THAT(lint, IsOk());
    EXPECT_EQ(lint->exit.exit_code, 0) << lint->output;
    EXPECT_EQ(lint->output, "");
  }

  auto exit = coordinator->process.Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0) << coordinator->process.stderr_text();
  EXPECT_THAT(coordinator->process.stderr_text(), HasSubstr("shutting down"));
}

// What a Kubernetes pod needs: flags spelled with dashes, one JSON object per log line, ended
// jobs counted, and SIGTERM obeyed at once even while a client follows a job (a watch stream would
// otherwise hold the gRPC shutdown for its whole 5 s grace).
TEST(DaemonsTest, DashedFlagsJsonLogsAndAPromptStopWithAWatcherOpen) {
  ScopedTempDir state("daemons_test");
  auto coordinator = StartDaemon("tessera-coordinator",
                                 {"--state=" + state.path() + "/db", "--log-format=json",
                                  "--heartbeat-timeout=7s", "--checkpoint-root=" + state.path()});
  ASSERT_THAT(coordinator, IsOk());
  const std::string cli = BinDir() + "/tessera --coordinator=" + coordinator->address;
  auto submitted = RunCommand({"/bin/sh", "-c",
                               "TESSERA_DATA_DIR=" + state.path() + " " + cli + " submit " +
                                   std::string(TESSERA_EXAMPLES_DIR) + "/tiny-gpt.yaml"});
  ASSERT_THAT(submitted, IsOk());
  ASSERT_EQ(submitted->exit.exit_code, 0) << submitted->output;
  const std::string job_id = submitted->output.substr(0, submitted->output.find('\n'));
  auto watcher = Subprocess::Start({BinDir() + "/tessera", "--coordinator=" + coordinator->address,
                                    "watch", job_id},
                                   {.merge_stdout = true, .extra_env = {}});
  ASSERT_THAT(watcher, IsOk());
  ASSERT_THAT(watcher->WaitForStderrLine("[PENDING]"), IsOk());

  absl::StatusOr<testing::HttpResponse> metrics;
  testing::WaitUntil(
      [&] {
        metrics = HttpGet(coordinator->metrics_port, "/metrics");
        return !metrics.ok() ||
               absl::StrContains(metrics->body, "tessera_jobs{state=\"pending\"} 1");
      },
      absl::Seconds(10), absl::Milliseconds(100));
  ASSERT_THAT(metrics, IsOk());
  EXPECT_THAT(metrics->body, HasSubstr("tessera_jobs{state=\"pending\"} 1"));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_jobs{state=\"succeeded\"} 0"));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_jobs{state=\"failed\"} 0"));
  EXPECT_THAT(metrics->body, HasSubstr("tessera_job_oldest_pending_seconds "));

  const absl::Time signalled = absl::Now();
  auto exit = coordinator->process.Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0);
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(3)) << "waited out the gRPC grace";
  // The watch outlives the coordinator: it waits to resume after the last event it printed, on
  // this coordinator back or on another that leads (client/coordinator_client.h), until it is
  // stopped or a minute passes without one.
  auto watch_exit = watcher->Wait(absl::Seconds(2));
  EXPECT_FALSE(watch_exit.ok()) << "the watch gave up as soon as the coordinator stopped";

  // Every line of the log is a JSON object naming the component, the startup line among them.
  const std::string log = coordinator->process.stderr_text();
  int lines = 0;
  bool serving = false;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    ++lines;
    const nlohmann::json parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(parsed.is_object()) << line;
    EXPECT_EQ(parsed.value("component", ""), "coordinator") << line;
    EXPECT_TRUE(parsed.contains("time")) << line;
    serving |= absl::StrContains(parsed.value("message", ""), "serving gRPC on");
  }
  EXPECT_GE(lines, 2);
  EXPECT_TRUE(serving) << log;
}

// gRPC's shutdown waits for every client connection to answer a ping after its GOAWAY. A client
// on gRPC's synchronous API polls its connection only during its own calls (and at a backup poll
// every 5 s, turned off here so the test does not depend on its phase), so an idle one answers
// nothing: the daemon must close such connections once no call is in flight, not wait out its
// grace.
TEST(DaemonsTest, AnIdleClientConnectionDoesNotHoldTheStop) {
  ScopedTempDir state("daemons_test");
  auto coordinator = StartDaemon("tessera-coordinator", {"--state=" + state.path() + "/db"});
  ASSERT_THAT(coordinator, IsOk());
  // Read when this process initialises gRPC (the first channel); children started later do not
  // see it.
  ASSERT_EQ(setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "0", 1), 0);
  auto stub = v1::Coordinator::NewStub(MakeClientChannel(coordinator->address));
  grpc::ClientContext context;
  v1::ListJobsRequest request;
  v1::ListJobsResponse response;
  const grpc::Status listed = stub->ListJobs(&context, request, &response);
  ASSERT_EQ(unsetenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS"), 0);
  ASSERT_TRUE(listed.ok()) << listed.error_message();

  const absl::Time signalled = absl::Now();
  auto exit = coordinator->process.Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0) << coordinator->process.stderr_text();
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(2)) << "an idle connection held the shutdown";
  // The channel is still usable: its next call finds the coordinator gone.
  grpc::ClientContext after;
  after.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(stub->ListJobs(&after, request, &response).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(DaemonsTest, WorkerStartsAndStopsCleanly) {
  ScopedTempDir work("daemons_test");
  auto worker = StartDaemon("tessera-worker", {"--work_dir=" + work.path() + "/work"});
  ASSERT_THAT(worker, IsOk());
  auto metrics = HttpGet(worker->metrics_port, "/metrics");
  ASSERT_THAT(metrics, IsOk());
  EXPECT_THAT(metrics->body, HasSubstr("component=\"worker\""));
  auto exit = worker->process.Stop(SIGINT);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0);
}

// Readiness (the chart's probe): the worker's process serves health at once, but its service
// tessera.v1.Worker only while it is registered with a coordinator that answers.
TEST(DaemonsTest, AWorkerIsReadyOnlyWhileRegistered) {
  ScopedTempDir state("daemons_test");
  auto port = testing::PickFreePort();
  ASSERT_THAT(port, IsOk());
  const std::string coordinator_address = absl::StrCat("127.0.0.1:", *port);
  auto worker = StartDaemon("tessera-worker", {"--coordinator=" + coordinator_address,
                                               "--work_dir=" + state.path() + "/work",
                                               "--node_name=ready-test", "--cpu_slots=1"});
  ASSERT_THAT(worker, IsOk());
  auto health = grpc::health::v1::Health::NewStub(MakeClientChannel(worker->address));
  auto check = [&](const std::string& service) {
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::Status status = health->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  };
  auto wait_for = [&](grpc::health::v1::HealthCheckResponse::ServingStatus want) {
    testing::WaitUntil([&] { return check("tessera.v1.Worker") == want; }, absl::Seconds(20),
                       absl::Milliseconds(100));
    return check("tessera.v1.Worker");
  };
  using grpc::health::v1::HealthCheckResponse;
  EXPECT_EQ(check(""), HealthCheckResponse::SERVING) << "alive";
  // A registration attempt has failed (nothing listens at the coordinator's address yet).
  ASSERT_THAT(worker->process.WaitForStderrLine("cannot register with"), IsOk());
  EXPECT_EQ(check("tessera.v1.Worker"), HealthCheckResponse::NOT_SERVING) << "not registered";

  auto coordinator = Subprocess::Start(
      {BinDir() + "/tessera-coordinator", "--listen=" + coordinator_address, "--metrics_listen=",
       "--state=" + state.path() + "/db", "--heartbeat_interval=500ms"});
  ASSERT_THAT(coordinator, IsOk());
  ASSERT_THAT(coordinator->WaitForStderrLine("serving gRPC on"), IsOk());
  EXPECT_EQ(wait_for(HealthCheckResponse::SERVING), HealthCheckResponse::SERVING)
      << worker->process.stderr_text();

  // The coordinator goes away: the worker is alive but no longer ready.
  ASSERT_THAT(coordinator->Stop(SIGTERM), IsOk());
  EXPECT_EQ(wait_for(HealthCheckResponse::NOT_SERVING), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(check(""), HealthCheckResponse::SERVING);
  auto exit = worker->process.Stop(SIGTERM);
  ASSERT_THAT(exit, IsOk());
  EXPECT_EQ(exit->exit_code, 0);
}

TEST(DaemonsTest, CliReportsAnUnreachableCoordinator) {
  // Bind a port and release it, so nothing listens there.
  auto probe =
      RunCommand({BinDir() + "/tessera", "--coordinator=127.0.0.1:1", "--timeout=2s", "health"});
  ASSERT_THAT(probe, IsOk());
  EXPECT_EQ(probe->exit.exit_code, 1);
  EXPECT_THAT(probe->output, HasSubstr("coordinator at 127.0.0.1:1"));
}

TEST(DaemonsTest, ABusyPortFailsWithAClearMessage) {
  ScopedTempDir state("daemons_test");
  auto first = StartDaemon("tessera-coordinator", {"--state=" + state.path() + "/first.db"});
  ASSERT_THAT(first, IsOk());
  auto second = RunCommand({BinDir() + "/tessera-coordinator", "--listen=" + first->address,
                            "--metrics_listen=", "--state=" + state.path() + "/second.db"});
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(second->exit.exit_code, 1);
  EXPECT_THAT(second->output, HasSubstr("cannot listen on " + first->address));
}

}  // namespace
}  // namespace tessera
