// The real tessera-coordinator's side of worker liveness and load: a worker that restarted or
// fell silent fails its jobs, heartbeats are answered while client calls wait for a locked state
// database, and client calls beyond the bounded queue are told to retry. And the cluster's shape:
// nodes name their topology domains, inconsistent ones are refused, and ListNodes, `tessera nodes
// --topology` and /metrics show the tree and each level's figures.

#include <sqlite3.h>

#include <atomic>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/coordinator_fixture.h"
#include "tests/util/subprocess.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(CoordinatorTest, AWorkerThatRestartedFailsItsJobs) {
  RegisterNode("restarting", 0, 2);
  v1::Job job = Submit(ValidSpec("victim"));
  job = WaitForJob(job.job_id(),
                   [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(Heartbeat("restarting").start_size(), 1);  // delivered
  // The worker comes back empty-handed: the attempt is over (decided on the next tick).
  RegisterNode("restarting", 0, 2);
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_FAILED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("restarted"));
}

class CoordinatorLivenessTest : public CoordinatorTest {
 protected:
  void SetUp() override { Start({"--heartbeat_timeout=1s"}); }
};

TEST_F(CoordinatorLivenessTest, ASilentNodeIsLostAndItsJobFails) {
  RegisterNode("flaky", 0, 2);
  v1::Job job = Submit(ValidSpec("on-flaky"));
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() != v1::JOB_STATE_PENDING; });
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  // No heartbeats from now on.
  job =
      WaitForJob(job.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_FAILED; });
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("node flaky was lost"));
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NODE_LOST);
  v1::ListNodesRequest list;
  list.set_include_lost(true);
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub_->ListNodes(Context().get(), list, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 1);
  EXPECT_EQ(listed.nodes(0).state(), v1::NODE_STATE_LOST);
  // A lost node that comes back is told to register again.
  EXPECT_TRUE(Heartbeat("flaky").reregister());
}

// Holds the write lock of the coordinator's state database from a connection of its own, as a
// disk that does not answer would: the coordinator's commits wait (up to its busy timeout) until
// Release or destruction.
class StateLock {
 public:
  explicit StateLock(const std::string& path) {
    if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE, nullptr) != SQLITE_OK) return;
    sqlite3_busy_timeout(db_, 10000);
    held_ = sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) == SQLITE_OK;
    EXPECT_TRUE(held_) << sqlite3_errmsg(db_);
  }
  ~StateLock() {
    Release();
    sqlite3_close(db_);
  }
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;

  bool held() const { return held_; }
  void Release() {
    if (held_) {
      EXPECT_EQ(sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
    }
    held_ = false;
  }

 private:
  sqlite3* db_ = nullptr;
  bool held_ = false;
};

// gRPC runs callback handlers on a few threads of its own (half the cores, at least 2, at most
// 16). Calls that wait on the disk do that on the coordinator's executors instead, so that a
// slow commit does not stall the node's heartbeats. Here the store's database is held locked by
// another connection while more submissions than gRPC has threads wait for their commits; a
// heartbeat and a health check must still be answered promptly, and every submission lands
// once the lock is released.
TEST_F(CoordinatorTest, HeartbeatsAreAnsweredWhileSubmissionsWaitForTheDisk) {
  RegisterNode("n1", 0, 4);
  StateLock lock(dir_.path() + "/state.db");
  ASSERT_TRUE(lock.held());

  constexpr int kSubmissions = 40;  // more than gRPC's threads on any machine
  std::vector<grpc::Status> statuses(kSubmissions);
  std::vector<std::string> job_ids(kSubmissions);
  std::vector<std::thread> submitters;
  // Connected first, so that a call is on the wire as soon as its thread makes it.
  ASSERT_TRUE(channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  std::atomic<int> calling = 0;
  // Calls answered so far; the vectors are read only after the threads are joined.
  std::atomic<int> answered = 0;
  for (int i = 0; i < kSubmissions; ++i) {
    submitters.emplace_back([&, i] {
      v1::SubmitJobRequest request;
      *request.mutable_spec() = ValidSpec(absl::StrCat("waits-", i));
      v1::SubmitJobResponse response;
      ++calling;
      statuses[i] = stub_->SubmitJob(Context(60).get(), request, &response);
      job_ids[i] = response.job().job_id();
      ++answered;
    });
  }
  EXPECT_TRUE(testing::WaitUntil([&] { return calling == kSubmissions; }, absl::Seconds(30)));
  // Every call reached the coordinator (and waits there for the database).
  EXPECT_TRUE(testing::WaitUntil([&] { return StartedCalls("SubmitJob") == kSubmissions; },
                                 absl::Seconds(30)))
      << StartedCalls("SubmitJob") << " of " << kSubmissions << " calls started";

  const absl::Time start = absl::Now();
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("n1");
  v1::HeartbeatResponse heartbeat_response;
  const grpc::Status heartbeat_status =
      nodes_->Heartbeat(Context(3).get(), heartbeat, &heartbeat_response);
  EXPECT_TRUE(heartbeat_status.ok()) << heartbeat_status.error_message();
  EXPECT_FALSE(heartbeat_response.reregister());
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest check;
  grpc::health::v1::HealthCheckResponse checked;
  const grpc::Status health_status = health->Check(Context(3).get(), check, &checked);
  EXPECT_TRUE(health_status.ok()) << health_status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  // Still waiting: the lock is held, so none of them can have been stored (or answered).
  EXPECT_EQ(answered.load(), 0);

  lock.Release();
  for (std::thread& submitter : submitters) submitter.join();
  std::set<std::string> distinct;
  for (int i = 0; i < kSubmissions; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    distinct.insert(job_ids[i]);
  }
  EXPECT_EQ(distinct.size(), static_cast<size_t>(kSubmissions));
  v1::ListJobsRequest list;
  list.set_page_size(100);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), kSubmissions);
}

// Client calls wait for a thread in a bounded queue: beyond --max_queued_client_calls the
// coordinator answers RESOURCE_EXHAUSTED with a retry hint at once instead of holding the call
// in memory, and the calls it accepted still complete.
class CoordinatorBusyTest : public CoordinatorTest {
 protected:
  void SetUp() override { Start({"--client_call_threads=1", "--max_queued_client_calls=2"}); }
};

TEST_F(CoordinatorBusyTest, ClientCallsBeyondTheQueueAreToldToRetry) {
  StateLock lock(dir_.path() + "/state.db");
  ASSERT_TRUE(lock.held());

  // The first submission takes the one thread and waits for the database; two more wait in the
  // queue; the other five are refused at once.
  auto submit = [&](int i, std::string* retry_after) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = ValidSpec(absl::StrCat("busy-", i));
    v1::SubmitJobResponse response;
    auto context = Context(60);
    const grpc::Status status = stub_->SubmitJob(context.get(), request, &response);
    const auto& trailing = context->GetServerTrailingMetadata();
    if (auto it = trailing.find("retry-after-ms"); it != trailing.end()) {
      *retry_after = std::string(it->second.data(), it->second.size());
    }
    return status;
  };
  std::vector<grpc::Status> statuses(8);
  std::vector<std::string> retry_after(8);
  std::vector<absl::Time> answered(8);
  std::vector<std::thread> submitters;
  // Connected first, so that a call is on the wire as soon as its thread makes it.
  ASSERT_TRUE(channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + absl::Seconds(10))));
  std::atomic<int> calling = 0;
  std::atomic<int> answered_count = 0;
  for (int i = 0; i < 8; ++i) {
    submitters.emplace_back([&, i] {
      ++calling;
      statuses[i] = submit(i, &retry_after[i]);
      answered[i] = absl::Now();
      ++answered_count;
    });
    if (i == 0) {
      // The first call holds the one client-call thread (waiting for the database) before the
      // others come.
      EXPECT_TRUE(testing::WaitUntil(
          [&] {
            return MetricValue("tessera_call_executor_busy_threads{executor=\"client-calls\"}") ==
                   1;
          },
          absl::Seconds(30)));
    }
  }
  // The five refusals come back at once (the accepted calls wait for the database): then the
  // queue is full and every call has been seen.
  EXPECT_TRUE(testing::WaitUntil([&] { return answered_count == 5; }, absl::Seconds(30)))
      << answered_count << " calls answered while the database was locked";
  const absl::Time unlocked = absl::Now();
  lock.Release();
  for (std::thread& submitter : submitters) submitter.join();
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].error_message();
  int accepted = 0;
  int refused = 0;
  for (int i = 0; i < 8; ++i) {
    if (statuses[i].ok()) {
      ++accepted;
      continue;
    }
    ++refused;
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << i << ": " << statuses[i].error_message();
    EXPECT_THAT(statuses[i].error_message(), HasSubstr("retry in 1 s"));
    EXPECT_EQ(retry_after[i], "1000") << i;
    EXPECT_LT(answered[i], unlocked) << i << ": refused only after the database was unlocked";
  }
  EXPECT_EQ(accepted, 3);
  EXPECT_EQ(refused, 5);
  EXPECT_EQ(MetricValue("tessera_call_executor_refused_total{executor=\"client-calls\"}"), 5);
  v1::ListJobsRequest list;
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(Context().get(), list, &listed).ok());
  EXPECT_EQ(listed.jobs_size(), 3);
}

class CoordinatorTopologyTest : public CoordinatorTest {
 protected:
  void SetUp() override { Start({"--topology_levels=rack:200,block:50"}); }

  grpc::Status Register(const std::string& node_id, int cpu_slots,
                        const std::map<std::string, std::string>& topology) {
    v1::RegisterNodeRequest request;
    request.set_node_id(node_id);
    request.set_address(node_id + ".cluster.local:50052");
    request.mutable_resources()->set_cpu_slots(cpu_slots);
    for (const auto& [level, domain] : topology) (*request.mutable_topology())[level] = domain;
    v1::RegisterNodeResponse response;
    return nodes_->RegisterNode(Context().get(), request, &response);
  }
};

TEST_F(CoordinatorTopologyTest, NodesNameTheirDomainsAndTheTreeShowsWhatIsFree) {
  ASSERT_TRUE(Register("a1", 4, {{"rack", "r1"}, {"block", "b1"}}).ok());
  ASSERT_TRUE(Register("a2", 4, {{"rack", "r1"}, {"block", "b1"}}).ok());
  ASSERT_TRUE(Register("b1", 4, {{"rack", "r2"}, {"block", "b1"}}).ok());
  ASSERT_TRUE(Register("c1", 4, {{"rack", "r3"}, {"block", "b2"}}).ok());
  ASSERT_TRUE(Register("solo", 4, {}).ok()) << "a node without labels is a domain of its own";

  // Refused, naming the node and the label: a rack in two blocks, a level not configured.
  grpc::Status refused = Register("x1", 4, {{"rack", "r1"}, {"block", "b2"}});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(
      refused.error_message(),
      HasSubstr("node x1: topology rack=r1 is in block=b1 (node a1 says so), not block=b2"));
  refused = Register("x2", 4, {{"row", "7"}});
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), HasSubstr("unknown level row (levels: rack < block)"));

  // A 2-slot job takes part of one domain.
  const v1::Job job = Submit(ValidSpec("topo"));
  ASSERT_EQ(WaitForJob(job.job_id(),
                       [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; })
                .state(),
            v1::JOB_STATE_SCHEDULED);

  v1::ListNodesRequest request;
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub_->ListNodes(Context().get(), request, &listed).ok());
  ASSERT_EQ(listed.topology_levels_size(), 2);
  const v1::TopologyLevelStatus& racks = listed.topology_levels(0);
  EXPECT_EQ(racks.name(), "rack");
  EXPECT_EQ(racks.bandwidth_gbps(), 200);
  EXPECT_EQ(racks.domains(), 4);  // r1, r2, r3 and solo
  EXPECT_EQ(racks.free(), 18);
  EXPECT_EQ(racks.whole_free_domains(), 3) << "one domain holds the job";
  EXPECT_GT(racks.fragmentation(), 0);
  EXPECT_LT(racks.fragmentation(), 1);
  EXPECT_EQ(listed.topology_levels(1).name(), "block");
  EXPECT_EQ(listed.topology_levels(1).domains(), 3);  // b1, b2 and solo
  int64_t rack_free = 0;
  for (const v1::TopologyDomainStatus& domain : listed.topology_domains()) {
    if (domain.level() == 0) rack_free += domain.free();
    if (domain.level() == 0 && domain.domain() == "r1") {
      EXPECT_EQ(domain.parent(), "b1");
      EXPECT_THAT(domain.node_ids(), ::testing::ElementsAre("a1", "a2"));
    }
  }
  EXPECT_EQ(rack_free, 18);
  for (const v1::Node& node : listed.nodes()) {
    if (node.node_id() != "a1") continue;
    EXPECT_EQ(node.topology().at("rack"), "r1");
  }

  auto cli = testing::RunCommand(
      {BinDir() + "/tessera", "--coordinator=" + address_, "nodes", "--topology"});
  ASSERT_THAT(cli, IsOk());
  EXPECT_EQ(cli->exit.exit_code, 0) << cli->output;
  EXPECT_THAT(cli->output, HasSubstr("topology, CPU slots of ready nodes:"));
  EXPECT_THAT(cli->output, HasSubstr("  block b1 "));
  EXPECT_THAT(cli->output, HasSubstr("    rack r1 "));
  EXPECT_THAT(cli->output, HasSubstr("      a1\n"));
  EXPECT_THAT(cli->output, HasSubstr("  node solo (no block label)"));
  EXPECT_THAT(cli->output, HasSubstr("fragmentation"));

  // /metrics: each level's figures, from the next counted pass.
  EXPECT_TRUE(testing::WaitUntil(
      [&] { return MetricValue(R"(tessera_topology_domains{level="rack"})") == 4; },
      absl::Seconds(10), absl::Milliseconds(50)));
  EXPECT_EQ(MetricValue(R"(tessera_topology_domains{level="block"})"), 3);
  EXPECT_EQ(MetricValue(R"(tessera_topology_free_devices{level="rack"})"), 18);
  // b1's 12 slots, less the job's 2 if it landed there.
  EXPECT_GE(MetricValue(R"(tessera_topology_largest_free_domain_devices{level="block"})"), 10);
}

// placement.required keeps a gang inside one domain of the level: the fullest that holds it;
// when none has room the job waits naming the level and the largest free domain. A level the
// cluster does not have is refused at submission.
TEST_F(CoordinatorTopologyTest, ARequiredLevelKeepsTheGangInOneDomainOrSaysWhyItWaits) {
  ASSERT_TRUE(Register("a1", 4, {{"rack", "r1"}, {"block", "b1"}}).ok());
  ASSERT_TRUE(Register("a2", 4, {{"rack", "r1"}, {"block", "b1"}}).ok());
  ASSERT_TRUE(Register("b1", 4, {{"rack", "r2"}, {"block", "b1"}}).ok());

  v1::JobSpec spec = ValidSpec("in-one-rack");
  spec.mutable_resources()->set_cpu_slots(8);
  spec.mutable_batch()->set_global_batch_size(16);
  spec.mutable_placement()->set_required("row");
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  grpc::Status refused = stub_->SubmitJob(Context().get(), request, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(),
              HasSubstr("placement.required: 'row' is not a topology level of this cluster "
                        "(its levels: rack, block"));

  spec.mutable_placement()->set_required("rack");
  const v1::Job placed = Submit(spec);
  const v1::Job scheduled = WaitForJob(
      placed.job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_SCHEDULED; });
  ASSERT_EQ(scheduled.state(), v1::JOB_STATE_SCHEDULED) << scheduled.reason();
  ASSERT_EQ(scheduled.placements_size(), 8);
  for (const v1::RankPlacement& rank : scheduled.placements()) {
    EXPECT_THAT(rank.node_id(), ::testing::AnyOf("a1", "a2")) << "rank " << rank.rank();
  }

  spec.set_name("waits");
  const v1::Job waiting = Submit(spec);
  const std::string expected =
      "needs 8 CPU slots inside one rack (placement.required); the largest free rack, r2, "
      "offers 4";
  const v1::Job pending =
      WaitForJob(waiting.job_id(), [&](const v1::Job& j) { return j.reason() == expected; });
  EXPECT_EQ(pending.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(pending.reason(), expected);
}

}  // namespace
}  // namespace tessera
