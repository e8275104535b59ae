// Node admission on the real daemons: a node id cannot be taken over by another node key while
// its node is alive; a worker needs the join token to register, and the coordinator relays a
// job's logs from the worker over mutual TLS (the worker admits no other caller); the worker's
// ShardCache service admits only peer workers' certificates.


#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/shard_cache.grpc.pb.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/security_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(SecurityTest, ANodeIdCannotBeTakenOverWhileItsNodeIsAlive) {
  StartCoordinator({"--heartbeat_timeout=2s"});
  const Caller node = Token("node", kNodeToken);
  auto stub = v1::NodeService::NewStub(node.channel);
  v1::RegisterNodeResponse registered;
  ASSERT_TRUE(stub->RegisterNode(Context(node).get(), NodeRequest("gpu-1", "key-a"), &registered)
                  .ok());
  // Another key, same id, while gpu-1 is alive: refused.
  grpc::Status taken =
      stub->RegisterNode(Context(node).get(), NodeRequest("gpu-1", "key-b"), &registered);
  EXPECT_EQ(taken.error_code(), Code::ALREADY_EXISTS) << taken.error_message();
  EXPECT_THAT(taken.error_message(), HasSubstr("registered by another worker"));
  // Nor may it speak for the node.
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("gpu-1");
  heartbeat.set_node_key("key-b");
  v1::HeartbeatResponse beat;
  EXPECT_EQ(stub->Heartbeat(Context(node).get(), heartbeat, &beat).error_code(),
            Code::PERMISSION_DENIED);
  v1::ReportRequest report;
  report.set_node_id("gpu-1");
  report.set_node_key("key-b");
  report.add_reports()->set_job_id("job-x");
  v1::ReportResponse reported;
  EXPECT_EQ(stub->Report(Context(node).get(), report, &reported).error_code(),
            Code::PERMISSION_DENIED);
  v1::WatchAssignmentsRequest watch;
  watch.set_node_id("gpu-1");
  watch.set_node_key("key-b");
  auto watch_context = Context(node);
  auto watcher = stub->WatchAssignments(watch_context.get(), watch);
  v1::AssignmentsNotice notice;
  EXPECT_FALSE(watcher->Read(&notice));
  EXPECT_EQ(watcher->Finish().error_code(), Code::PERMISSION_DENIED);
  // The same worker (same key) registers again, e.g. after a restart.
  EXPECT_TRUE(
      stub->RegisterNode(Context(node).get(), NodeRequest("gpu-1", "key-a"), &registered).ok());
  // Once gpu-1 is LOST (silent past the heartbeat timeout), the id is free again.
  grpc::Status status;
  testing::WaitUntil(
      [&] {
        status =
            stub->RegisterNode(Context(node).get(), NodeRequest("gpu-1", "key-b"), &registered);
        return status.ok();
      },
      absl::Seconds(15), absl::Milliseconds(250));
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(SecurityTest, WorkersNeedTheJoinTokenAndLogsFlowOverMutualTls) {
  StartCoordinator();
  auto worker_argv = [&](const std::string& name, const std::string& work_dir) {
    return std::vector<std::string>{BinDir() + "/tessera-worker",
                                    "--coordinator=" + address_,
                                    "--node_name=" + name,
                                    "--listen=127.0.0.1:0",
                                    "--metrics_listen=",
                                    "--cpu_slots=2",
                                    "--work_dir=" + dir_.path() + "/" + work_dir,
                                    "--trainer=" + BinDir() + "/../tests/fake_trainer",
                                    "--tls_cert=" + worker_cert_.cert_file,
                                    "--tls_key=" + worker_cert_.key_file,
                                    "--tls_ca=" + pki_->ca_file(),
                                    "--tls_allowed_callers=tessera-coordinator"};
  };
  // A rogue worker: a valid certificate but no join token, and its certificate's CN is no node.
  auto rogue = Subprocess::Start(worker_argv("rogue", "rogue-work"));
  ASSERT_THAT(rogue, IsOk());
  auto refused = rogue->WaitForStderrLine("cannot register");
  ASSERT_THAT(refused, IsOk()) << rogue->stderr_text();
  EXPECT_THAT(*refused, HasSubstr("not a user of the auth file"));

  const std::string token_file = dir_.path() + "/join-token";
  WriteAtomically(token_file, std::string(kNodeToken) + "\n");
  std::vector<std::string> argv = worker_argv("cpu-1", "work-1");
  argv.push_back("--join_token_file=" + token_file);
  testing::SubprocessOptions options;
  options.extra_env = {"TESSERA_FAKE_TRAINER_ARGS_RANK0=--lines=3 --sleep=120",
                       "TESSERA_FAKE_TRAINER_ARGS_RANK1=--lines=3 --sleep=120"};
  auto worker = Subprocess::Start(argv, options);
  ASSERT_THAT(worker, IsOk());
  auto worker_line = worker->WaitForStderrLine("serving gRPC on");
  ASSERT_THAT(worker_line, IsOk()) << worker->stderr_text();
  std::smatch match;
  const std::string serving = *worker_line;
  ASSERT_TRUE(std::regex_search(serving, match, std::regex(R"(serving gRPC on \S+:(\d+))")));
  const std::string worker_address = absl::StrCat("127.0.0.1:", match[1].str());
  ASSERT_THAT(worker->WaitForStderrLine("registered with"), IsOk()) << worker->stderr_text();

  const Caller admin = Admin();
  auto stub = v1::Coordinator::NewStub(admin.channel);
  v1::ListNodesResponse listed;
  ASSERT_TRUE(stub->ListNodes(Context(admin).get(), {}, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 1);
  EXPECT_EQ(listed.nodes(0).node_id(), "cpu-1");

  // A second worker under the same name (another work directory: another node key).
  std::vector<std::string> twin_argv = worker_argv("cpu-1", "work-twin");
  twin_argv.push_back("--join_token_file=" + token_file);
  auto twin = Subprocess::Start(twin_argv);
  ASSERT_THAT(twin, IsOk());
  auto twin_refused = twin->WaitForStderrLine("cannot register");
  ASSERT_THAT(twin_refused, IsOk()) << twin->stderr_text();
  EXPECT_THAT(twin->stderr_text(), HasSubstr("registered by another worker"));

  // alice's job runs on cpu-1; her logs come through the coordinator, which calls the worker
  // with its own certificate (the only caller the worker admits).
  const Caller alice = Token("alice", kAliceToken);
  const std::string job_id = SubmitAs(alice, "logs-over-mtls");
  auto alice_stub = v1::Coordinator::NewStub(alice.channel);
  std::string logs;
  grpc::Status status;
  testing::WaitUntil(
      [&] {
        v1::GetLogsRequest request;
        request.set_job_id(job_id);
        request.set_rank(-1);
        request.set_attempt(-1);
        auto context = Context(alice);
        auto reader = alice_stub->GetLogs(context.get(), request);
        v1::LogChunk chunk;
        logs.clear();
        while (reader->Read(&chunk)) logs += chunk.data();
        status = reader->Finish();
        return logs.find("line 2") != std::string::npos;
      },
      absl::Seconds(30), absl::Milliseconds(300));
  EXPECT_THAT(logs, HasSubstr("line 2")) << status.error_message();

  // A user certificate signed by the same CA cannot read the worker's logs directly.
  auto direct = v1::Worker::NewStub(Channel(worker_address, Tls(&admin_cert_)));
  v1::GetNodeResponse node;
  grpc::Status direct_status = direct->GetNode(Context(admin).get(), {}, &node);
  EXPECT_EQ(direct_status.error_code(), Code::PERMISSION_DENIED) << direct_status.error_message();

  ASSERT_TRUE(stub->ListNodes(Context(admin).get(), {}, &listed).ok());
  ASSERT_EQ(listed.nodes_size(), 1);
  EXPECT_EQ(listed.nodes(0).node_id(), "cpu-1");
}

// Checkpoint shards hold a job's weights: only workers may put or read them. By default a worker
// admits its own certificate's CN (workers sharing one); --tls_allowed_callers (the coordinator)
// does not open this service, and a user certificate from the same CA is refused.
TEST_F(SecurityTest, TheShardCacheAdmitsOnlyPeerWorkers) {
  StartCoordinator();
  auto start_worker = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> argv = {BinDir() + "/tessera-worker",
                                     "--coordinator=" + address_,
                                     "--node_name=" + name,
                                     "--listen=127.0.0.1:0",
                                     "--metrics_listen=",
                                     "--cpu_slots=1",
                                     "--shard_cache_bytes=1048576",
                                     "--work_dir=" + dir_.path() + "/" + name,
                                     "--trainer=" + BinDir() + "/../tests/fake_trainer",
                                     "--tls_cert=" + worker_cert_.cert_file,
                                     "--tls_key=" + worker_cert_.key_file,
                                     "--tls_ca=" + pki_->ca_file(),
                                     "--tls_allowed_callers=tessera-coordinator"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return Subprocess::Start(argv);
  };
  auto address_of = [](Subprocess& worker) -> std::string {
    auto line = worker.WaitForStderrLine("serving gRPC on");
    EXPECT_THAT(line, IsOk()) << worker.stderr_text();
    if (!line.ok()) return "";
    std::smatch match;
    const std::string serving = *line;
    if (!std::regex_search(serving, match, std::regex(R"(serving gRPC on \S+:(\d+))"))) return "";
    return absl::StrCat("127.0.0.1:", match[1].str());
  };
  // DropJob of an unknown job: the cheapest call, OK with 0 shards once admitted.
  auto drop_job = [&](const std::string& address, const PemFiles& identity) {
    auto stub = v1::ShardCache::NewStub(Channel(address, Tls(&identity)));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::DropJobRequest request;
    request.set_job_id("no-such-job");
    v1::DropJobResponse response;
    return stub->DropJob(&context, request, &response);
  };

  auto worker = start_worker("cache-default", {});
  ASSERT_THAT(worker, IsOk());
  const std::string address = address_of(*worker);
  ASSERT_FALSE(address.empty());
  // A peer worker (same certificate CN): admitted, for every method.
  grpc::Status peer = drop_job(address, worker_cert_);
  EXPECT_TRUE(peer.ok()) << peer.error_message();
  {
    auto stub = v1::ShardCache::NewStub(Channel(address, Tls(&worker_cert_)));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetShardRequest request;
    request.mutable_key()->set_job_id("no-such-job");
    auto reader = stub->Get(&context, request);
    v1::GetShardChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), Code::NOT_FOUND);
  }
  // A user certificate, and the coordinator's (the only caller of the Worker service): refused.
  for (const PemFiles* outsider : {&admin_cert_, &coordinator_cert_}) {
    grpc::Status refused = drop_job(address, *outsider);
    EXPECT_EQ(refused.error_code(), Code::PERMISSION_DENIED) << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("--shard_cache_allowed_callers"));
  }
  {
    // A put from an outsider stores nothing: refused before the first byte is kept.
    auto stub = v1::ShardCache::NewStub(Channel(address, Tls(&admin_cert_)));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PutShardResponse response;
    auto writer = stub->Put(&context, &response);
    v1::PutShardChunk chunk;
    chunk.mutable_header()->mutable_key()->set_job_id("j");
    chunk.mutable_header()->set_xxh3_128("00");
    chunk.mutable_header()->set_size_bytes(1);
    chunk.set_data("x");
    writer->Write(chunk);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), Code::PERMISSION_DENIED);
  }

  // An explicit list replaces the default: here the user's CN only, so the worker CN is refused.
  auto listed = start_worker("cache-listed", {"--shard_cache_allowed_callers=ops"});
  ASSERT_THAT(listed, IsOk());
  const std::string listed_address = address_of(*listed);
  ASSERT_FALSE(listed_address.empty());
  EXPECT_TRUE(drop_job(listed_address, admin_cert_).ok());
  EXPECT_EQ(drop_job(listed_address, worker_cert_).error_code(), Code::PERMISSION_DENIED);
}

}  // namespace
}  // namespace tessera
