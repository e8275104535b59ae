// Authentication and authorization on the real tessera-coordinator: every RPC times every kind
// of caller (no credentials, a foreign CA, an expired certificate, plaintext, a revoked token,
// viewer, owner, another user, admin by certificate, node) gets the expected code and no call
// without valid credentials is ever accepted (counted); per-user submit rate and open-stream
// limits; the CLI's credentials from its config file or the environment.


#include <sys/stat.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/security_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST_F(SecurityTest, EveryRpcTimesEveryCallerGetsTheExpectedCode) {
  StartCoordinator();
  std::vector<Caller> callers = Callers();
  const Caller alice = Token("alice", kAliceToken);
  const std::string alice_job = SubmitAs(alice, "alice-job");
  ASSERT_FALSE(alice_job.empty());

  using Rpc = std::function<grpc::Status(const Caller&)>;
  auto coordinator = [](const Caller& caller) { return v1::Coordinator::NewStub(caller.channel); };
  auto nodes = [](const Caller& caller) { return v1::NodeService::NewStub(caller.channel); };
  std::map<std::string, Rpc> rpcs;
  rpcs["SubmitJob"] = [&](const Caller& caller) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = Spec("table-job");
    v1::SubmitJobResponse response;
    return coordinator(caller)->SubmitJob(Context(caller).get(), request, &response);
  };
  rpcs["GetJob"] = [&](const Caller& caller) {
    v1::GetJobRequest request;
    request.set_job_id(alice_job);
    v1::GetJobResponse response;
    grpc::Status status = coordinator(caller)->GetJob(Context(caller).get(), request, &response);
    if (status.ok()) {
      EXPECT_EQ(response.job().owner(), "alice");
    }
    return status;
  };
  rpcs["ListJobs"] = [&](const Caller& caller) {
    v1::ListJobsResponse response;
    return coordinator(caller)->ListJobs(Context(caller).get(), {}, &response);
  };
  rpcs["WatchJob"] = [&](const Caller& caller) {
    v1::WatchJobRequest request;
    request.set_job_id(alice_job);
    auto context = Context(caller);
    auto reader = coordinator(caller)->WatchJob(context.get(), request);
    v1::JobEvent event;
    // A pending job's stream stays open after its events: one event is the call's success.
    if (reader->Read(&event)) {
      context->TryCancel();
      reader->Finish().IgnoreError();
      return grpc::Status::OK;
    }
    return reader->Finish();
  };
  rpcs["GetMetrics"] = [&](const Caller& caller) {
    v1::GetMetricsRequest request;
    request.set_job_id(alice_job);
    v1::GetMetricsResponse response;
    return coordinator(caller)->GetMetrics(Context(caller).get(), request, &response);
  };
  rpcs["ListCheckpoints"] = [&](const Caller& caller) {
    v1::ListCheckpointsRequest request;
    request.set_job_id(alice_job);
    v1::ListCheckpointsResponse response;
    return coordinator(caller)->ListCheckpoints(Context(caller).get(), request, &response);
  };
  rpcs["ListNodes"] = [&](const Caller& caller) {
    v1::ListNodesResponse response;
    grpc::Status status = coordinator(caller)->ListNodes(Context(caller).get(), {}, &response);
    for (const auto& node : response.nodes()) EXPECT_TRUE(node.key_sha256().empty());
    return status;
  };
  rpcs["ListQueues"] = [&](const Caller& caller) {
    v1::ListQueuesResponse response;
    grpc::Status status = coordinator(caller)->ListQueues(Context(caller).get(), {}, &response);
    if (status.ok()) {
      EXPECT_EQ(response.queues_size(), 1);
    }
    return status;
  };
  // Node operations: administrators only. n1 is drained and undrained (RegisterNode runs first); RemoveNode names a node that never registered, so that an admin gets NOT_FOUND
  // (authorization comes before the lookup) and the node calls below still find n1.
  rpcs["DrainNode"] = [&](const Caller& caller) {
    v1::DrainNodeRequest request;
    request.set_node_id("n1");
    v1::DrainNodeResponse response;
    grpc::Status status = coordinator(caller)->DrainNode(Context(caller).get(), request, &response);
    if (status.ok()) {
      // Undrained again at once: the calls after this one (PlanLayout) need n1's capacity.
      v1::UndrainNodeRequest undrain;
      undrain.set_node_id("n1");
      v1::UndrainNodeResponse undrained;
      EXPECT_TRUE(coordinator(caller)->UndrainNode(Context(caller).get(), undrain, &undrained).ok());
    }
    return status;
  };
  rpcs["UndrainNode"] = [&](const Caller& caller) {
    v1::UndrainNodeRequest request;
    request.set_node_id("n1");
    v1::UndrainNodeResponse response;
    return coordinator(caller)->UndrainNode(Context(caller).get(), request, &response);
  };
  rpcs["RemoveNode"] = [&](const Caller& caller) {
    v1::RemoveNodeRequest request;
    request.set_node_id("never-registered");
    v1::RemoveNodeResponse response;
    return coordinator(caller)->RemoveNode(Context(caller).get(), request, &response);
  };
  rpcs["PlanLayout"] = [&](const Caller& caller) {
    v1::PlanLayoutRequest request;
    *request.mutable_spec() = Spec("plan");
    v1::PlanLayoutResponse response;
    return coordinator(caller)->PlanLayout(Context(caller).get(), request, &response);
  };
  rpcs["CancelJob"] = [&](const Caller& caller) {
    // A fresh job of alice's for every caller.
    v1::CancelJobRequest request;
    request.set_job_id(SubmitAs(alice, "cancel-me"));
    v1::CancelJobResponse response;
    return coordinator(caller)->CancelJob(Context(caller).get(), request, &response);
  };
  rpcs["GetLogs"] = [&](const Caller& caller) {
    v1::GetLogsRequest request;
    request.set_job_id(alice_job);
    request.set_rank(-1);
    request.set_attempt(-1);
    auto context = Context(caller);
    auto reader = coordinator(caller)->GetLogs(context.get(), request);
    v1::LogChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  };
  rpcs["RegisterNode"] = [&](const Caller& caller) {
    v1::RegisterNodeResponse response;
    return nodes(caller)->RegisterNode(Context(caller).get(), NodeRequest("n1", "key-1"),
                                       &response);
  };
  rpcs["Heartbeat"] = [&](const Caller& caller) {
    v1::HeartbeatRequest request;
    request.set_node_id("n1");
    request.set_node_key("key-1");
    v1::HeartbeatResponse response;
    return nodes(caller)->Heartbeat(Context(caller).get(), request, &response);
  };
  rpcs["WatchAssignments"] = [&](const Caller& caller) {
    v1::WatchAssignmentsRequest request;
    request.set_node_id("n1");
    request.set_node_key("key-1");
    auto context = Context(caller);
    auto reader = nodes(caller)->WatchAssignments(context.get(), request);
    v1::AssignmentsNotice notice;
    // The stream opens with a notice and stays open: that notice is the call's success.
    if (reader->Read(&notice)) {
      context->TryCancel();
      reader->Finish().IgnoreError();
      return grpc::Status::OK;
    }
    return reader->Finish();
  };
  rpcs["Report"] = [&](const Caller& caller) {
    v1::ReportRequest request;
    request.set_node_id("n1");
    request.set_node_key("key-1");
    v1::ReportResponse response;
    return nodes(caller)->Report(Context(caller).get(), request, &response);
  };

  // Expected codes of the authenticated callers; the unauthenticated ones get UNAUTHENTICATED
  // (valid TLS, nothing valid presented) or UNAVAILABLE (the handshake fails).
  const Code kOk = Code::OK, kDenied = Code::PERMISSION_DENIED;
  // Reading is for viewer, user and admin; a pending job has no logs (FAILED_PRECONDITION).
  const std::map<std::string, std::map<std::string, Code>> expected = {
      {"SubmitJob",
       {{"viewer", kDenied},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"GetJob",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"ListJobs",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"WatchJob",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"GetMetrics",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"ListCheckpoints",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"ListNodes",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"ListQueues",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"DrainNode",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"UndrainNode",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"RemoveNode",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", Code::NOT_FOUND},
        {"node", kDenied}}},
      {"PlanLayout",
       {{"viewer", kOk},
        {"alice (owner)", kOk},
        {"bob (not owner)", kOk},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"CancelJob",
       {{"viewer", kDenied},
        {"alice (owner)", kOk},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kOk},
        {"node", kDenied}}},
      {"GetLogs",
       {{"viewer", kDenied},
        {"alice (owner)", Code::FAILED_PRECONDITION},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", Code::FAILED_PRECONDITION},
        {"node", kDenied}}},
      {"RegisterNode",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kDenied},
        {"node", kOk}}},
      {"Heartbeat",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kDenied},
        {"node", kOk}}},
      {"Report",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kDenied},
        {"node", kOk}}},
      {"WatchAssignments",
       {{"viewer", kDenied},
        {"alice (owner)", kDenied},
        {"bob (not owner)", kDenied},
        {"admin (certificate)", kDenied},
        {"node", kOk}}},
  };

  int unauthenticated_calls = 0;
  int unauthenticated_accepted = 0;
  int checked = 0;
  std::vector<std::string> mismatches;
  // RegisterNode first, so that Heartbeat, Report and WatchAssignments find the node.
  std::vector<std::string> order = {"RegisterNode"};
  for (const auto& [name, rpc] : rpcs) {
    if (name != "RegisterNode") order.push_back(name);
  }
  for (const std::string& name : order) {
    for (const Caller& caller : callers) {
      grpc::Status status = rpcs[name](caller);
      ++checked;
      if (caller.unauthenticated) {
        ++unauthenticated_calls;
        if (status.ok()) ++unauthenticated_accepted;
        const Code want = caller.name == "no credentials" || caller.name == "revoked token"
                              ? Code::UNAUTHENTICATED
                              : Code::UNAVAILABLE;
        if (status.error_code() != want) {
          mismatches.push_back(absl::StrCat(name, " by ", caller.name, ": ",
                                            CodeName(status.error_code()), " (",
                                            status.error_message(), "), want ", CodeName(want)));
        }
        continue;
      }
      const Code want = expected.at(name).at(caller.name);
      if (status.error_code() != want) {
        mismatches.push_back(absl::StrCat(name, " by ", caller.name, ": ",
                                          CodeName(status.error_code()), " (",
                                          status.error_message(), "), want ", CodeName(want)));
      }
    }
  }
  EXPECT_EQ(checked, static_cast<int>(rpcs.size() * callers.size()));
  EXPECT_EQ(unauthenticated_calls, static_cast<int>(rpcs.size()) * 5);
  EXPECT_EQ(unauthenticated_accepted, 0);
  EXPECT_TRUE(mismatches.empty()) << absl::StrJoin(mismatches, "\n");

  // Who submitted is recorded: alice's jobs are hers, the admin's are "ops".
  auto stub = v1::Coordinator::NewStub(Admin().channel);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub->ListJobs(Context(Admin()).get(), {}, &listed).ok());
  std::map<std::string, int> owners;
  for (const auto& job : listed.jobs()) ++owners[job.owner()];
  EXPECT_GT(owners["alice"], 0);
  EXPECT_EQ(owners["bob"], 1);
  EXPECT_EQ(owners["ops"], 1);
  EXPECT_EQ(owners.size(), 3u);
}

TEST_F(SecurityTest, SubmitRateAndOpenStreamsArePerUser) {
  StartCoordinator({"--max_submits_per_minute=2", "--max_streams_per_client=1"});
  const Caller alice = Token("alice", kAliceToken);
  const Caller bob = Token("bob", kBobToken);
  SubmitAs(alice, "one");
  const std::string job_id = SubmitAs(alice, "two");
  auto stub = v1::Coordinator::NewStub(alice.channel);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = Spec("three");
  v1::SubmitJobResponse response;
  auto context = Context(alice);
  grpc::Status limited = stub->SubmitJob(context.get(), request, &response);
  EXPECT_EQ(limited.error_code(), Code::RESOURCE_EXHAUSTED);
  EXPECT_THAT(limited.error_message(), HasSubstr("retry in"));
  auto retry = context->GetServerTrailingMetadata().find("retry-after-ms");
  ASSERT_NE(retry, context->GetServerTrailingMetadata().end());
  const int retry_ms = std::stoi(std::string(retry->second.data(), retry->second.size()));
  EXPECT_GT(retry_ms, 0);
  EXPECT_LE(retry_ms, 30000);
  // Another user is not held back by alice.
  SubmitAs(bob, "bobs");

  // One open stream per user: a second watch is refused until the first ends.
  v1::WatchJobRequest watch;
  watch.set_job_id(job_id);
  auto first_context = Context(alice, 60);
  auto first = stub->WatchJob(first_context.get(), watch);
  v1::JobEvent event;
  ASSERT_TRUE(first->Read(&event));
  auto open_second = [&]() {
    auto second_context = Context(alice);
    auto second = stub->WatchJob(second_context.get(), watch);
    v1::JobEvent second_event;
    if (second->Read(&second_event)) {
      second_context->TryCancel();
      second->Finish().IgnoreError();
      return grpc::Status::OK;
    }
    return second->Finish();
  };
  grpc::Status second = open_second();
  EXPECT_EQ(second.error_code(), Code::RESOURCE_EXHAUSTED) << second.error_message();
  first_context->TryCancel();
  first->Finish().IgnoreError();
  // The slot is given back once the coordinator has seen the cancellation.
  const bool reopened = testing::WaitUntil([&] { return open_second().ok(); }, absl::Seconds(10),
                                           absl::Milliseconds(100));
  EXPECT_TRUE(reopened);
}

// The CLI: TLS and the token from its config file or TESSERA_TOKEN; `list` shows owners.
TEST_F(SecurityTest, TheCliConnectsWithItsConfigFileOrTheEnvironment) {
  StartCoordinator();
  const std::string job_id = SubmitAs(Token("alice", kAliceToken), "alices-job");
  const std::string config = dir_.path() + "/cli.yaml";
  WriteAtomically(config, absl::StrCat("coordinator: ", address_, "\ntls_ca: ", pki_->ca_file(),
                                       "\ntoken: ", kBobToken, "\n"));
  ASSERT_EQ(chmod(config.c_str(), 0600), 0);
  auto run = [&](std::vector<std::string> args, std::vector<std::string> env) {
    args.insert(args.begin(), BinDir() + "/tessera");
    auto cli = Subprocess::Start(args, {.merge_stdout = true, .extra_env = std::move(env)});
    EXPECT_THAT(cli, IsOk());
    auto exit = cli->Wait(absl::Seconds(30));
    EXPECT_THAT(exit, IsOk());
    return std::make_pair(exit.ok() ? exit->exit_code : -1, cli->stderr_text());
  };
  auto [code, output] = run({"--config=" + config, "list"}, {});
  EXPECT_EQ(code, 0) << output;
  EXPECT_THAT(output, ::testing::ContainsRegex("alices-job"));
  EXPECT_THAT(output, HasSubstr(" alice "));
  // The environment's token wins over the file's: bob may not cancel alice's job.
  std::tie(code, output) =
      run({"--config=" + config, "cancel", job_id}, {absl::StrCat("TESSERA_TOKEN=", kBobToken)});
  EXPECT_EQ(code, 1);
  EXPECT_THAT(output, HasSubstr("permission denied: user bob")) << output;
  std::tie(code, output) =
      run({"--config=" + config, "cancel", job_id}, {absl::StrCat("TESSERA_TOKEN=", kAliceToken)});
  EXPECT_EQ(code, 0) << output;
  // Without the CA the handshake fails; without a token the call is refused.
  std::tie(code, output) = run({"--coordinator=" + address_, "list"}, {"TESSERA_CONFIG=/nonexistent"});
  EXPECT_EQ(code, 2) << output;  // a named config file that is missing
  std::tie(code, output) = run({"--coordinator=" + address_, "--tls_ca=" + pki_->ca_file(), "list"},
                               {"HOME=" + dir_.path(), "TESSERA_TOKEN="});
  EXPECT_EQ(code, 1);
  EXPECT_THAT(output, HasSubstr("unauthenticated: credentials required")) << output;
}

}  // namespace
}  // namespace tessera
