// Two real tessera-coordinator processes on one private PostgreSQL database
// (tests/postgres_fixture.h), as the HA contract has them (docs/coordinator.md "High
// availability"): exactly one serves tessera.v1.Coordinator, the standby answers UNAVAILABLE
// naming the leader (message and `tessera-leader` metadata) and serves health and /metrics; a
// job submitted to the leader is served by the standby after `kill -9` of the leader, within the
// lease, the poll and the state's loading; and a leader stopped (SIGSTOP) until the standby has
// taken over exits with status 3 when it runs again, having stored nothing more; a leader
// stopped by SIGTERM hands the lease over at once; and a restart
// of the PostgreSQL server under a stream of submissions loses none that returned OK.
//
// Skipped (with the fixture's reason) when PostgreSQL cannot start.
//
// Thread safety: one test thread; the coordinators are processes.
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/daemon/server.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/postgres_fixture.h"
#include "tests/util/http_get.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::PostgresCluster;
using ::tessera::testing::Subprocess;
using ::testing::HasSubstr;

// Short enough for a test, long enough for a loaded 2-core machine to renew in time.
constexpr char kLease[] = "--leader_lease_seconds=2";
constexpr char kPoll[] = "--standby_poll_seconds=0.2";

struct Coordinator {
  std::optional<Subprocess> process;
  std::string address;
  int metrics_port = 0;
  // The plaintext health-only port (--health_listen), which the leader keeps from its standby.
  int health_port = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub;
};

class CoordinatorFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    url_ = PostgresCluster::Shared().NewDatabase();
    if (url_.empty()) GTEST_SKIP() << PostgresCluster::Shared().Reason();
  }

  // Starts a coordinator and waits until it serves its port (as a standby at first).
  void Start(Coordinator& coordinator, const std::string& lease = kLease) {
    auto process = Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                      "--metrics_listen=127.0.0.1:0",
                                      "--health_listen=127.0.0.1:0", "--state=" + url_, lease,
                                      kPoll, "--max_submits_per_minute=0"});
    ASSERT_THAT(process, IsOk());
    coordinator.process.emplace(std::move(*process));
    auto line = coordinator.process->WaitForStderrLine("standby serving gRPC on");
    ASSERT_THAT(line, IsOk());
    std::smatch match;
    ASSERT_TRUE(std::regex_search(
        *line, match,
        std::regex(R"(serving gRPC on (\S+:\d+), metrics on port (\d+), health on port (\d+))")));
    coordinator.address = match[1];
    coordinator.metrics_port = std::stoi(match[2]);
    coordinator.health_port = std::stoi(match[3]);
    coordinator.stub = v1::Coordinator::NewStub(MakeClientChannel(coordinator.address));
  }

  // Waits for the "leading" line and then for the leader's servers.
  void WaitUntilLeading(Coordinator& coordinator, int epoch,
                        absl::Duration timeout = absl::Seconds(30)) {
    auto leading = coordinator.process->WaitForStderrLine("leading with epoch", timeout);
    ASSERT_THAT(leading, IsOk());
    EXPECT_THAT(*leading, HasSubstr(absl::StrCat("leading with epoch ", epoch, " as ")));
    ASSERT_THAT(coordinator.process->WaitForStderrLine(
                    absl::StrCat("serving gRPC on ", coordinator.address), timeout),
                IsOk());
    // Probes keep asking the standby's health port: the leader serves it, and is ready there
    // once its state is loaded.
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
          return Health(coordinator, "tessera.v1.Coordinator", coordinator.health_port) ==
                 grpc::health::v1::HealthCheckResponse::SERVING;
        },
        timeout, absl::Milliseconds(100)))
        << "the leader is not ready on health port " << coordinator.health_port;
  }

  // The health of `service` on the coordinator's main port, or on `port` of its host.
  static grpc::health::v1::HealthCheckResponse::ServingStatus Health(const Coordinator& coordinator,
                                                                     const std::string& service,
                                                                     int port = 0) {
    auto health = grpc::health::v1::Health::NewStub(MakeClientChannel(
        port == 0 ? coordinator.address : absl::StrCat("127.0.0.1:", port)));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status status = health->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  // SubmitJob with a deadline; the job id on success.
  static grpc::Status Submit(const Coordinator& coordinator, const std::string& name,
                             std::string* job_id) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = testing::TinyCpuJobSpec(name);
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status status = coordinator.stub->SubmitJob(&context, request, &response);
    if (status.ok()) *job_id = response.job().job_id();
    return status;
  }

  static grpc::Status ListJobs(const Coordinator& coordinator, std::vector<std::string>* ids,
                               std::multimap<std::string, std::string>* trailers = nullptr) {
    // Every page.
    if (ids != nullptr) ids->clear();
    v1::ListJobsRequest request;
    request.set_page_size(1000);
    v1::ListJobsResponse response;
    grpc::Status status;
    do {
      request.set_page_token(response.next_page_token());
      grpc::ClientContext page_context;
      page_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      status = coordinator.stub->ListJobs(&page_context, request, &response);
      if (!status.ok()) {
        if (trailers != nullptr) {
          trailers->clear();
          for (const auto& [key, value] : page_context.GetServerTrailingMetadata()) {
            trailers->emplace(std::string(key.data(), key.size()),
                              std::string(value.data(), value.size()));
          }
        }
        return status;
      }
      for (const v1::Job& job : response.jobs()) {
        if (ids != nullptr) ids->push_back(job.job_id());
      }
    } while (!response.next_page_token().empty());
    if (ids != nullptr) std::sort(ids->begin(), ids->end());
    if (trailers != nullptr) trailers->clear();
    return status;
  }

  // The leader's A and the standby's B, A leading with epoch 1.
  void StartPair() {
    ASSERT_NO_FATAL_FAILURE(Start(a_));
    ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(a_, 1));
    ASSERT_NO_FATAL_FAILURE(Start(b_));
  }

  std::string url_;
  Coordinator a_;
  Coordinator b_;
};

TEST_F(CoordinatorFailoverTest, OneLeadsAndTheStandbyNamesIt) {
  ASSERT_NO_FATAL_FAILURE(StartPair());
  EXPECT_EQ(Health(a_, "tessera.v1.Coordinator"), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(b_, "tessera.v1.Coordinator"),
            grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(b_, ""), grpc::health::v1::HealthCheckResponse::SERVING);

  // The standby learns the leader at its first poll.
  std::multimap<std::string, std::string> trailers;
  grpc::Status refused;
  testing::WaitUntil(
      [&] {
        refused = ListJobs(b_, nullptr, &trailers);
        return trailers.count("tessera-leader") > 0;
      },
      absl::Seconds(10), absl::Milliseconds(100));
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(refused.error_message(), absl::StrCat("coordinator ", b_.address,
                                                  " is a standby; the leader is at ", a_.address));
  ASSERT_EQ(trailers.count("tessera-leader"), 1u);
  EXPECT_EQ(trailers.find("tessera-leader")->second, a_.address);

  // The workers' service too; the leader's answers carry its epoch.
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("node-1");
  v1::HeartbeatResponse response;
  {
    auto nodes = v1::NodeService::NewStub(MakeClientChannel(b_.address));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    EXPECT_EQ(nodes->Heartbeat(&context, heartbeat, &response).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  {
    auto nodes = v1::NodeService::NewStub(MakeClientChannel(a_.address));
    v1::RegisterNodeRequest request;
    request.set_node_id("node-1");
    request.set_hostname("node-1");
    request.set_address("node-1.cluster.local:50052");
    request.mutable_resources()->set_cpu_slots(2);
    v1::RegisterNodeResponse registered;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    const grpc::Status status = nodes->RegisterNode(&context, request, &registered);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(registered.leader_epoch(), 1);
  }

  auto leader_metrics = testing::HttpGet(a_.metrics_port, "/metrics");
  ASSERT_THAT(leader_metrics, IsOk());
  EXPECT_THAT(leader_metrics->body, HasSubstr("\ntessera_coordinator_leader 1"));
  EXPECT_THAT(leader_metrics->body, HasSubstr("\ntessera_coordinator_leader_epoch 1"));
  auto standby_metrics = testing::HttpGet(b_.metrics_port, "/metrics");
  ASSERT_THAT(standby_metrics, IsOk());
  EXPECT_THAT(standby_metrics->body, HasSubstr("\ntessera_coordinator_leader 0"));
  EXPECT_THAT(standby_metrics->body, HasSubstr("\ntessera_coordinator_leader_epoch 1"));
}

TEST_F(CoordinatorFailoverTest, AfterKillNineTheStandbyServesTheLeadersJobs) {
  ASSERT_NO_FATAL_FAILURE(StartPair());
  std::string job_id;
  const grpc::Status submitted = Submit(a_, "before-failover", &job_id);
  ASSERT_TRUE(submitted.ok()) << submitted.error_message();

  const auto killed = std::chrono::steady_clock::now();
  ASSERT_THAT(a_.process->Stop(SIGKILL), IsOk());
  std::vector<std::string> ids;
  testing::WaitUntil([&] { return ListJobs(b_, &ids).ok(); }, absl::Seconds(20),
                     absl::Milliseconds(50));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  EXPECT_THAT(ids, ::testing::ElementsAre(job_id));
  // The lease (2 s), a poll (0.2 s) and loading a nearly empty state, with room for a loaded
  // machine: the HA goal.
  EXPECT_LT(seconds, 10) << "the standby took " << seconds << " s to serve";
  ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(b_, 2, absl::Seconds(1)));
  EXPECT_EQ(Health(b_, "tessera.v1.Coordinator"), grpc::health::v1::HealthCheckResponse::SERVING);
  std::string second_id;
  const grpc::Status after = Submit(b_, "after-failover", &second_id);
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_NE(second_id, job_id);
}

TEST_F(CoordinatorFailoverTest, APausedLeaderThatWakesAfterATakeoverExitsAndStoresNothing) {
  ASSERT_NO_FATAL_FAILURE(StartPair());
  std::string first;
  ASSERT_TRUE(Submit(a_, "before-pause", &first).ok());

  ASSERT_EQ(kill(a_.process->pid(), SIGSTOP), 0);
  ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(b_, 2));
  std::string second;
  const grpc::Status on_new_leader = Submit(b_, "on-the-new-leader", &second);
  ASSERT_TRUE(on_new_leader.ok()) << on_new_leader.error_message();

  ASSERT_EQ(kill(a_.process->pid(), SIGCONT), 0);
  // Whatever the old leader still answers, nothing of it may be stored.
  std::string ignored;
  const grpc::Status on_old_leader = Submit(a_, "on-the-old-leader", &ignored);
  EXPECT_FALSE(on_old_leader.ok()) << "the deposed leader accepted job " << ignored;
  auto exited = a_.process->Wait(absl::Seconds(10));
  ASSERT_THAT(exited, IsOk());
  EXPECT_EQ(exited->exit_code, 3) << a_.process->stderr_text();
  EXPECT_THAT(a_.process->stderr_text(),
              HasSubstr("tessera-coordinator: lost leadership (epoch 1, "));

  // The store holds what the new leader accepted, and only that.
  std::vector<std::string> ids;
  ASSERT_TRUE(ListJobs(b_, &ids).ok());
  std::vector<std::string> expected = {first, second};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(ids, expected);
}

TEST_F(CoordinatorFailoverTest, ALeaderStoppedBySigtermHandsTheLeaseOver) {
  // A lease far longer than the test: only a release lets the standby in.
  const std::string lease = "--leader_lease_seconds=60";
  ASSERT_NO_FATAL_FAILURE(Start(a_, lease));
  ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(a_, 1));
  ASSERT_NO_FATAL_FAILURE(Start(b_, lease));
  std::string job_id;
  ASSERT_TRUE(Submit(a_, "before-handover", &job_id).ok());
  auto stopped = a_.process->Stop(SIGTERM);
  ASSERT_THAT(stopped, IsOk());
  EXPECT_EQ(stopped->exit_code, 0) << a_.process->stderr_text();
  ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(b_, 2, absl::Seconds(15)));
  std::vector<std::string> ids;
  ASSERT_TRUE(ListJobs(b_, &ids).ok());
  EXPECT_THAT(ids, ::testing::ElementsAre(job_id));
}

TEST_F(CoordinatorFailoverTest, ADatabaseRestartUnderLoadLosesNoAcceptedJob) {
  // The default lease: a restart of a second or two is shorter, so the leader stays.
  auto process = Subprocess::Start({BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                    "--metrics_listen=127.0.0.1:0", "--state=" + url_, kPoll,
                                    "--leader_lease_seconds=5", "--max_submits_per_minute=0"});
  ASSERT_THAT(process, IsOk());
  a_.process.emplace(std::move(*process));
  auto line = a_.process->WaitForStderrLine("standby serving gRPC on");
  ASSERT_THAT(line, IsOk());
  std::smatch match;
  ASSERT_TRUE(std::regex_search(*line, match, std::regex(R"(serving gRPC on (\S+:\d+))")));
  a_.address = match[1];
  a_.stub = v1::Coordinator::NewStub(MakeClientChannel(a_.address));
  ASSERT_NO_FATAL_FAILURE(WaitUntilLeading(a_, 1));

  // Submitters on threads of their own while the server restarts under them.
  absl::Mutex mu;
  std::vector<std::string> accepted;
  int refused = 0;
  std::atomic<bool> stop{false};
  std::vector<std::thread> submitters;
  for (int t = 0; t < 3; ++t) {
    submitters.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        std::string job_id;
        const grpc::Status status = Submit(a_, absl::StrCat("load-", t, "-", i), &job_id);
        absl::MutexLock lock(&mu);
        if (status.ok()) {
          accepted.push_back(job_id);
        } else {
          ++refused;
        }
      }
    });
  }
  auto accepted_count = [&] {
    absl::MutexLock lock(&mu);
    return accepted.size();
  };
  // Load flows, then the server restarts under it; then submissions are accepted again (the
  // coordinator reconnected, and stayed the leader).
  EXPECT_TRUE(testing::WaitUntil([&] { return accepted_count() >= 10; }, absl::Seconds(30)))
      << "no load before the restart";
  const bool restarted = PostgresCluster::Shared().Restart();
  const size_t before = accepted_count();
  EXPECT_TRUE(
      testing::WaitUntil([&] { return accepted_count() >= before + 10; }, absl::Seconds(30)))
      << "submissions not accepted again after the database restart\n"
      << a_.process->stderr_text();
  stop = true;
  for (std::thread& submitter : submitters) submitter.join();
  ASSERT_TRUE(restarted) << "pg_ctl restart failed";

  std::vector<std::string> ids;
  const grpc::Status listed = ListJobs(a_, &ids);
  ASSERT_TRUE(listed.ok()) << listed.error_message() << "\n" << a_.process->stderr_text();
  absl::MutexLock lock(&mu);
  std::sort(accepted.begin(), accepted.end());
  EXPECT_GT(accepted.size(), 10u) << "too little load to tell";
  // Every job whose submission returned OK is stored; a refused one may be too (a commit whose
  // reply was lost), so the stored ones include the accepted ones.
  std::vector<std::string> missing;
  std::set_difference(accepted.begin(), accepted.end(), ids.begin(), ids.end(),
                      std::back_inserter(missing));
  EXPECT_THAT(missing, ::testing::IsEmpty()) << refused << " submissions were refused";
  // Still the leader, with the same epoch: the outage was shorter than the lease.
  EXPECT_THAT(a_.process->stderr_text(), ::testing::Not(HasSubstr("lost leadership")));
  EXPECT_EQ(Health(a_, "tessera.v1.Coordinator"), grpc::health::v1::HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace tessera
