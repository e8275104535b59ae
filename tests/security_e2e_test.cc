// Security end to end: the real tessera-coordinator (and tessera-worker) on
// 127.0.0.1 with TLS, an auth file and mutual TLS, driven over gRPC.
//
// - Every RPC x every kind of caller (no credentials, a certificate of another
//   CA, an expired certificate, plaintext, viewer, user on their own job, user
//   on another's job, admin by client certificate, node) gets the expected
//   code; no call without valid credentials is ever accepted (counted).
// - A worker without the join token cannot register or get work; a node id
//   cannot be taken over by another node key while its node is alive.
// - Tokens (auth file) and certificates rotate without a restart.
// - Per-user submit rate and open-stream limits answer RESOURCE_EXHAUSTED.
// - Plaintext beyond loopback needs --insecure.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/daemon/server.h"
#include "common/read_file.h"
#include "common/security/tls.h"
#include "common/status_matchers.h"
#include "coordinator/auth.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "tests/util/test_pki.h"

namespace tessera {
namespace {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::PemFiles;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::tessera::testing::TestPki;
using ::testing::HasSubstr;
using Code = grpc::StatusCode;

constexpr char kViewerToken[] = "viewer-token-0123456789";
constexpr char kAliceToken[] = "alice-token-0123456789";
constexpr char kBobToken[] = "bob-token-0123456789";
constexpr char kNodeToken[] = "node-join-token-0123456789";

v1::JobSpec Spec(const std::string& name) { return testing::TinyCpuJobSpec(name); }

std::string AuthFile(const std::string& alice_token) {
  return absl::StrCat("users:\n",                                                     //
                      "  - name: viewer\n    roles: [viewer]\n    token_sha256: [",  //
                      coordinator::TokenSha256(kViewerToken), "]\n",                   //
                      "  - name: alice\n    roles: [user]\n    token_sha256: [",     //
                      coordinator::TokenSha256(alice_token), "]\n",                    //
                      "  - name: bob\n    roles: [user]\n    token_sha256: [",       //
                      coordinator::TokenSha256(kBobToken), "]\n",                      //
                      "  - name: ops\n    roles: [admin]\n",                            //
                      "  - name: workers\n    roles: [node]\n    token_sha256: [",   //
                      coordinator::TokenSha256(kNodeToken), "]\n");
}

// Writes `text` to `path` atomically (a rename, as a Kubernetes Secret update does).
void WriteAtomically(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp);
    out << text;
  }
  ASSERT_EQ(std::rename(temp.c_str(), path.c_str()), 0);
}

void CopyAtomically(const std::string& from, const std::string& to) {
  auto text = ReadWholeFile(from);
  ASSERT_THAT(text, IsOk());
  WriteAtomically(to, *text);
}

// One kind of caller: how it connects and what it presents.
struct Caller {
  std::string name{};
  std::shared_ptr<grpc::Channel> channel{};
  std::string token{};
  // A caller that must never get OK.
  bool unauthenticated = false;
};

// TLS credentials straight from PEM text, skipping CheckTlsFiles (which would refuse an
// expired certificate before the server could).
std::shared_ptr<grpc::ChannelCredentials> RawTlsCredentials(const std::string& ca_file,
                                                            const PemFiles& identity) {
  auto ca = ReadWholeFile(ca_file);
  auto cert = ReadWholeFile(identity.cert_file);
  auto key = ReadWholeFile(identity.key_file);
  EXPECT_TRUE(ca.ok() && cert.ok() && key.ok());
  auto provider = std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
      *ca, std::vector<grpc::experimental::IdentityKeyCertPair>{{*key, *cert}});
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

// A channel of its own (no subchannel shared with other callers' channels).
std::shared_ptr<grpc::Channel> Channel(const std::string& address,
                                       std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, credentials, arguments);
}

std::unique_ptr<grpc::ClientContext> Context(const Caller& caller, int seconds = 10) {
  auto context = testing::ContextWithDeadline(seconds);
  if (!caller.token.empty()) context->AddMetadata("authorization", "Bearer " + caller.token);
  return context;
}

std::string CodeName(Code code) {
  static const std::map<Code, std::string> kNames = {
      {Code::OK, "OK"},
      {Code::UNAUTHENTICATED, "UNAUTHENTICATED"},
      {Code::PERMISSION_DENIED, "PERMISSION_DENIED"},
      {Code::UNAVAILABLE, "UNAVAILABLE"},
      {Code::FAILED_PRECONDITION, "FAILED_PRECONDITION"},
      {Code::NOT_FOUND, "NOT_FOUND"},
      {Code::INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {Code::ALREADY_EXISTS, "ALREADY_EXISTS"},
      {Code::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
  };
  auto it = kNames.find(code);
  return it == kNames.end() ? absl::StrCat("code ", static_cast<int>(code)) : it->second;
}

class SecurityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto pki = TestPki::Create(dir_.path() + "/pki");
    ASSERT_THAT(pki, IsOk());
    pki_.emplace(std::move(*pki));
    auto other = TestPki::Create(dir_.path() + "/other", "other-ca");
    ASSERT_THAT(other, IsOk());
    other_pki_.emplace(std::move(*other));
    coordinator_cert_ = Issue("coordinator", "tessera-coordinator");
    worker_cert_ = Issue("worker", "tessera-worker");
    admin_cert_ = Issue("ops", "ops");
    auth_file_ = dir_.path() + "/auth.yaml";
    WriteAtomically(auth_file_, AuthFile(kAliceToken));
  }

  PemFiles Issue(const std::string& name, const std::string& common_name) {
    auto files = pki_->Issue(name, common_name);
    EXPECT_THAT(files, IsOk());
    return *files;
  }

  // Starts the coordinator with TLS and the auth file, plus `extra` flags.
  void StartCoordinator(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {BinDir() + "/tessera-coordinator",
                                     "--listen=127.0.0.1:0",
                                     "--metrics_listen=",
                                     "--state=" + dir_.path() + "/state.db",
                                     "--tls_cert=" + coordinator_cert_.cert_file,
                                     "--tls_key=" + coordinator_cert_.key_file,
                                     "--tls_ca=" + pki_->ca_file(),
                                     "--tls_reload_interval=1s",
                                     "--auth_file=" + auth_file_,
                                     "--worker_tls_name=localhost",
                                     "--heartbeat_interval=200ms",
                                     "--checkpoint_root=" + dir_.path() + "/checkpoints"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto process = Subprocess::Start(argv);
    ASSERT_THAT(process, IsOk());
    coordinator_.emplace(std::move(*process));
    auto line = coordinator_->WaitForStderrLine("serving gRPC on");
    ASSERT_THAT(line, IsOk()) << coordinator_->stderr_text();
    std::smatch match;
    ASSERT_TRUE(std::regex_search(*line, match, std::regex(R"(serving gRPC on \S+:(\d+))")));
    // The certificates name localhost and 127.0.0.1; dial the IP.
    address_ = absl::StrCat("127.0.0.1:", match[1].str());
  }

  std::shared_ptr<grpc::ChannelCredentials> Tls(const PemFiles* identity = nullptr) {
    TlsOptions options{.ca_file = pki_->ca_file()};
    if (identity != nullptr) {
      options.cert_file = identity->cert_file;
      options.key_file = identity->key_file;
    }
    auto credentials = MakeChannelCredentials(options);
    EXPECT_THAT(credentials, IsOk());
    return *credentials;
  }

  Caller Token(const std::string& name, const std::string& token) {
    return {.name = name, .channel = Channel(address_, Tls()), .token = token};
  }
  Caller Admin() { return {.name = "admin (certificate)", .channel = Channel(address_, Tls(&admin_cert_))}; }

  // Every kind of caller of the table.
  std::vector<Caller> Callers() {
    auto other_cert = other_pki_->Issue("rogue", "ops");
    auto expired = pki_->Issue("expired", "ops", absl::Now() - absl::Hours(48),
                               absl::Now() - absl::Hours(24));
    EXPECT_THAT(other_cert, IsOk());
    EXPECT_THAT(expired, IsOk());
    return {
        {.name = "no credentials", .channel = Channel(address_, Tls()), .unauthenticated = true},
        {.name = "certificate of another CA",
         .channel = Channel(address_, RawTlsCredentials(pki_->ca_file(), *other_cert)),
         .unauthenticated = true},
        {.name = "expired certificate",
         .channel = Channel(address_, RawTlsCredentials(pki_->ca_file(), *expired)),
         .unauthenticated = true},
        {.name = "plaintext",
         .channel = Channel(address_, grpc::InsecureChannelCredentials()),
         .token = kAliceToken,
         .unauthenticated = true},
        {.name = "revoked token",
         .channel = Channel(address_, Tls()),
         .token = "not-a-token",
         .unauthenticated = true},
        Token("viewer", kViewerToken),
        Token("alice (owner)", kAliceToken),
        Token("bob (not owner)", kBobToken),
        Admin(),
        Token("node", kNodeToken),
    };
  }

  std::string SubmitAs(const Caller& caller, const std::string& name) {
    auto stub = v1::Coordinator::NewStub(caller.channel);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = Spec(name);
    v1::SubmitJobResponse response;
    grpc::Status status = stub->SubmitJob(Context(caller).get(), request, &response);
    EXPECT_TRUE(status.ok()) << caller.name << ": " << status.error_message();
    return response.job().job_id();
  }

  v1::RegisterNodeRequest NodeRequest(const std::string& node_id, const std::string& key) {
    v1::RegisterNodeRequest request;
    request.set_node_id(node_id);
    request.set_hostname(node_id);
    request.set_address("127.0.0.1:1");
    request.set_node_key(key);
    request.mutable_resources()->set_cpu_slots(1);
    return request;
  }

  ScopedTempDir dir_;
  std::optional<TestPki> pki_;
  std::optional<TestPki> other_pki_;
  PemFiles coordinator_cert_, worker_cert_, admin_cert_;
  std::string auth_file_;
  std::optional<Subprocess> coordinator_;
  std::string address_;
};

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
      {"SubmitJob", {{"viewer", kDenied}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                     {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"GetJob", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                  {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"ListJobs", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                    {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"WatchJob", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                    {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"GetMetrics", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                      {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"ListCheckpoints", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                           {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"ListNodes", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                     {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"DrainNode", {{"viewer", kDenied}, {"alice (owner)", kDenied}, {"bob (not owner)", kDenied},
                     {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"UndrainNode", {{"viewer", kDenied}, {"alice (owner)", kDenied},
                       {"bob (not owner)", kDenied}, {"admin (certificate)", kOk},
                       {"node", kDenied}}},
      {"RemoveNode", {{"viewer", kDenied}, {"alice (owner)", kDenied}, {"bob (not owner)", kDenied},
                      {"admin (certificate)", Code::NOT_FOUND}, {"node", kDenied}}},
      {"PlanLayout", {{"viewer", kOk}, {"alice (owner)", kOk}, {"bob (not owner)", kOk},
                      {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"CancelJob", {{"viewer", kDenied}, {"alice (owner)", kOk}, {"bob (not owner)", kDenied},
                     {"admin (certificate)", kOk}, {"node", kDenied}}},
      {"GetLogs", {{"viewer", kDenied}, {"alice (owner)", Code::FAILED_PRECONDITION},
                   {"bob (not owner)", kDenied}, {"admin (certificate)", Code::FAILED_PRECONDITION},
                   {"node", kDenied}}},
      {"RegisterNode", {{"viewer", kDenied}, {"alice (owner)", kDenied},
                        {"bob (not owner)", kDenied}, {"admin (certificate)", kDenied},
                        {"node", kOk}}},
      {"Heartbeat", {{"viewer", kDenied}, {"alice (owner)", kDenied}, {"bob (not owner)", kDenied},
                     {"admin (certificate)", kDenied}, {"node", kOk}}},
      {"Report", {{"viewer", kDenied}, {"alice (owner)", kDenied}, {"bob (not owner)", kDenied},
                  {"admin (certificate)", kDenied}, {"node", kOk}}},
      {"WatchAssignments", {{"viewer", kDenied}, {"alice (owner)", kDenied},
                            {"bob (not owner)", kDenied}, {"admin (certificate)", kDenied},
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
  absl::Time deadline = absl::Now() + absl::Seconds(15);
  grpc::Status status;
  do {
    absl::SleepFor(absl::Milliseconds(250));
    status = stub->RegisterNode(Context(node).get(), NodeRequest("gpu-1", "key-b"), &registered);
  } while (!status.ok() && absl::Now() < deadline);
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
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  grpc::Status status;
  while (absl::Now() < deadline && logs.find("line 2") == std::string::npos) {
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
    absl::SleepFor(absl::Milliseconds(300));
  }
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

TEST_F(SecurityTest, TokensAndCertificatesRotateWithoutARestart) {
  StartCoordinator();
  const pid_t pid = coordinator_->pid();
  const Caller old_alice = Token("alice", kAliceToken);
  const Caller new_alice = Token("alice", "alice-rotated-token-42");
  auto list = [](const Caller& caller) {
    v1::ListJobsResponse response;
    return v1::Coordinator::NewStub(caller.channel)
        ->ListJobs(Context(caller).get(), {}, &response)
        .error_code();
  };
  EXPECT_EQ(list(old_alice), Code::OK);
  EXPECT_EQ(list(new_alice), Code::UNAUTHENTICATED);
  WriteAtomically(auth_file_, AuthFile("alice-rotated-token-42"));
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (list(new_alice) != Code::OK && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(list(new_alice), Code::OK);
  EXPECT_EQ(list(old_alice), Code::UNAUTHENTICATED);

  // A broken auth file keeps the previous users.
  // (The file is checked at most once a second, when a call comes.)
  WriteAtomically(auth_file_, "users: [oops\n");
  absl::SleepFor(absl::Milliseconds(1100));
  EXPECT_EQ(list(new_alice), Code::OK);
  ASSERT_THAT(coordinator_->WaitForStderrLine("keeping the previous users"), IsOk());
  EXPECT_EQ(list(new_alice), Code::OK);

  // The serving certificate is replaced (cert-manager renews it): new connections see the new
  // one, with the same process.
  auto server_cn = [&]() -> std::string {
    Caller caller = Token("alice", "alice-rotated-token-42");
    auto context = Context(caller);
    v1::ListJobsResponse response;
    if (!v1::Coordinator::NewStub(caller.channel)->ListJobs(context.get(), {}, &response).ok()) {
      return "";
    }
    return PeerCommonName(context->auth_context().get()).value_or("");
  };
  EXPECT_EQ(server_cn(), "tessera-coordinator");
  PemFiles renewed = Issue("coordinator-renewed", "tessera-coordinator-renewed");
  CopyAtomically(renewed.key_file, coordinator_cert_.key_file);
  CopyAtomically(renewed.cert_file, coordinator_cert_.cert_file);
  deadline = absl::Now() + absl::Seconds(10);
  while (server_cn() != "tessera-coordinator-renewed" && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(server_cn(), "tessera-coordinator-renewed");
  EXPECT_EQ(coordinator_->pid(), pid);
  EXPECT_EQ(kill(pid, 0), 0);
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
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool reopened = false;
  while (!(reopened = open_second().ok()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
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

TEST_F(SecurityTest, PlaintextBeyondLoopbackNeedsInsecure) {
  std::vector<std::string> argv = {BinDir() + "/tessera-coordinator", "--listen=0.0.0.0:0",
                                   "--metrics_listen=", "--state=" + dir_.path() + "/plain.db"};
  auto refused = Subprocess::Start(argv);
  ASSERT_THAT(refused, IsOk());
  auto exit = refused->Wait(absl::Seconds(30));
  ASSERT_THAT(exit, IsOk());
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_THAT(refused->stderr_text(), HasSubstr("--insecure"));

  argv.push_back("--insecure");
  auto insecure = Subprocess::Start(argv);
  ASSERT_THAT(insecure, IsOk());
  ASSERT_THAT(insecure->WaitForStderrLine("serving gRPC on"), IsOk());
  EXPECT_THAT(insecure->stderr_text(), HasSubstr("WARNING: serving plaintext"));
  EXPECT_THAT(insecure->stderr_text(), HasSubstr("WARNING: no --auth_file"));

  // Bad TLS files stop the coordinator at start, naming the flag.
  std::vector<std::string> bad = {BinDir() + "/tessera-coordinator", "--listen=127.0.0.1:0",
                                  "--metrics_listen=", "--state=" + dir_.path() + "/bad.db",
                                  "--tls_cert=" + coordinator_cert_.cert_file,
                                  "--tls_key=" + admin_cert_.key_file};
  auto mismatched = Subprocess::Start(bad);
  ASSERT_THAT(mismatched, IsOk());
  exit = mismatched->Wait(absl::Seconds(30));
  ASSERT_THAT(exit, IsOk());
  EXPECT_NE(exit->exit_code, 0);
  EXPECT_THAT(mismatched->stderr_text(), HasSubstr("--tls_key"));
}

}  // namespace
}  // namespace tessera
