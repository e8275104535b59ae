// The fixture of the security end-to-end tests (security_e2e_*_test.cc): a test PKI (and a
// second, foreign CA), an auth file with a viewer, two users, an admin (by client certificate) and
// the workers' join token, and the real tessera-coordinator started with TLS, that auth file and
// mutual TLS towards workers; the kinds of caller (credentials, certificates, tokens) the tests
// call it as.
#pragma once

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/daemon/server.h"
#include "common/read_file.h"
#include "common/security/tls.h"
#include "common/status_matchers.h"
#include "coordinator/auth/auth.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/job_specs.h"
#include "tests/util/subprocess.h"
#include "tests/util/temp_dir.h"
#include "tests/util/test_pki.h"
#include "tests/util/wait.h"

namespace tessera {

using ::tessera::testing::BinDir;
using ::tessera::testing::IsOk;
using ::tessera::testing::PemFiles;
using ::tessera::testing::ScopedTempDir;
using ::tessera::testing::Subprocess;
using ::tessera::testing::TestPki;
using Code = grpc::StatusCode;

inline constexpr char kViewerToken[] = "viewer-token-0123456789";
inline constexpr char kAliceToken[] = "alice-token-0123456789";
inline constexpr char kBobToken[] = "bob-token-0123456789";
inline constexpr char kNodeToken[] = "node-join-token-0123456789";

inline v1::JobSpec Spec(const std::string& name) { return testing::TinyCpuJobSpec(name); }

inline std::string AuthFile(const std::string& alice_token) {
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
inline void WriteAtomically(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp);
    out << text;
  }
  ASSERT_EQ(std::rename(temp.c_str(), path.c_str()), 0);
}

inline void CopyAtomically(const std::string& from, const std::string& to) {
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
inline std::shared_ptr<grpc::ChannelCredentials> RawTlsCredentials(const std::string& ca_file,
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
inline std::shared_ptr<grpc::Channel> Channel(const std::string& address,
                                       std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, credentials, arguments);
}

inline std::unique_ptr<grpc::ClientContext> Context(const Caller& caller, int seconds = 10) {
  auto context = testing::ContextWithDeadline(seconds);
  if (!caller.token.empty()) context->AddMetadata("authorization", "Bearer " + caller.token);
  return context;
}

inline std::string CodeName(Code code) {
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

}  // namespace tessera
