// Real gRPC servers on 127.0.0.1 port 0 with credentials from tls.h, called
// over TCP: server TLS, mutual TLS (required and requested), the file checks,
// hostname verification, and certificate rotation without a restart.

#include "common/security/tls.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/read_file.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/grpc_security_constants.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/temp_dir.h"
#include "tests/util/test_pki.h"
#include "tests/util/wait.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::tessera::testing::ContextWithDeadline;
using ::tessera::testing::IsOk;
using ::tessera::testing::PemFiles;
using ::tessera::testing::StatusIs;
using ::tessera::testing::TestPki;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Optional;

constexpr char kNoCertificate[] = "<no client certificate>";

// Answers GetNode with the CN of the caller's certificate as the hostname:
// how the coordinator will map a client certificate to a user.
class PeerNameService final : public v1::Worker::CallbackService {
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* request,
                                    v1::GetNodeResponse* response) override {
    std::optional<std::string> name = PeerCommonName(context->auth_context().get());
    response->mutable_node()->set_hostname(name.value_or(kNoCertificate));
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

class TestServer {
 public:
  static std::unique_ptr<TestServer> Start(std::shared_ptr<grpc::ServerCredentials> credentials) {
    auto server = std::unique_ptr<TestServer>(new TestServer);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &server->port_);
    builder.RegisterService(&server->service_);
    server->server_ = builder.BuildAndStart();
    if (server->server_ == nullptr || server->port_ == 0) return nullptr;
    return server;
  }
  ~TestServer() { server_->Shutdown(absl::ToChronoTime(absl::Now())); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  TestServer() = default;
  PeerNameService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// What one call over a fresh channel (and a fresh connection: no subchannel
// sharing with earlier channels) saw.
struct CallResult {
  grpc::Status status;
  std::optional<std::string> server_name;  // CN of the server's certificate
  std::string security_type;               // "tls" over these credentials
  std::string name_seen_by_server;         // GetNode only
};

grpc::ChannelArguments FreshConnectionArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return args;
}

CallResult CheckHealth(const std::string& address,
                       const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                       grpc::ChannelArguments args = FreshConnectionArgs()) {
  auto stub = Health::NewStub(grpc::CreateCustomChannel(address, credentials, args));
  auto context = ContextWithDeadline(5);
  HealthCheckResponse response;
  CallResult result;
  result.status = stub->Check(context.get(), HealthCheckRequest(), &response);
  if (result.status.ok() && response.status() != HealthCheckResponse::SERVING) {
    result.status = grpc::Status(grpc::StatusCode::INTERNAL, "health is not SERVING");
  }
  result.server_name = PeerCommonName(context->auth_context().get());
  for (const grpc::string_ref& type :
       context->auth_context()->FindPropertyValues(GRPC_TRANSPORT_SECURITY_TYPE_PROPERTY_NAME)) {
    result.security_type.assign(type.data(), type.size());
  }
  return result;
}

CallResult GetNode(const std::string& address,
                   const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  auto stub =
      v1::Worker::NewStub(grpc::CreateCustomChannel(address, credentials, FreshConnectionArgs()));
  auto context = ContextWithDeadline(5);
  v1::GetNodeResponse response;
  CallResult result;
  result.status = stub->GetNode(context.get(), v1::GetNodeRequest(), &response);
  result.name_seen_by_server = response.node().hostname();
  return result;
}

// Channel credentials straight from gRPC, skipping CheckTlsFiles: lets a
// client present a certificate the check would refuse (an expired one), to
// see that the server refuses it too.
std::shared_ptr<grpc::ChannelCredentials> UncheckedCredentials(const std::string& ca_file,
                                                               const PemFiles& identity) {
  auto provider = std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
      ReadWholeFile(ca_file).value(),
      std::vector<grpc::experimental::IdentityKeyCertPair>{
          {ReadWholeFile(identity.key_file).value(), ReadWholeFile(identity.cert_file).value()}});
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  return grpc::experimental::TlsCredentials(options);
}

// Replaces `to` by a copy of `from` in one rename, as cert-manager's atomic
// symlink swap or `mv` would.
void ReplaceFile(const std::string& from, const std::string& to) {
  const std::string temp = to + ".new";
  fs::copy_file(from, temp, fs::copy_options::overwrite_existing);
  fs::rename(temp, to);
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TestDir();
    auto pki = TestPki::Create(dir_ + "/ca");
    ASSERT_THAT(pki, IsOk());
    pki_ = std::make_unique<TestPki>(*std::move(pki));
    auto other = TestPki::Create(dir_ + "/other", "other-ca");
    ASSERT_THAT(other, IsOk());
    other_pki_ = std::make_unique<TestPki>(*std::move(other));
    auto server = pki_->Issue("server", "server");
    ASSERT_THAT(server, IsOk());
    server_files_ = *server;
  }

  // A server with this CA's "server" certificate; verifies clients with this
  // CA when `verify_clients`.
  std::unique_ptr<TestServer> StartServer(bool verify_clients, ClientCertPolicy policy) {
    TlsOptions options{.cert_file = server_files_.cert_file,
                       .key_file = server_files_.key_file,
                       .ca_file = verify_clients ? pki_->ca_file() : ""};
    auto credentials = MakeServerCredentials(options, policy);
    EXPECT_THAT(credentials, IsOk());
    if (!credentials.ok()) return nullptr;
    return TestServer::Start(*credentials);
  }

  std::shared_ptr<grpc::ChannelCredentials> Client(const TlsOptions& options) {
    auto credentials = MakeChannelCredentials(options);
    EXPECT_THAT(credentials, IsOk());
    return credentials.ok() ? *credentials : nullptr;
  }

  // A client trusting this CA and presenting a certificate with CN `name`
  // issued by `issuer`.
  std::shared_ptr<grpc::ChannelCredentials> ClientWithCert(TestPki& issuer,
                                                           const std::string& name) {
    auto files = issuer.Issue("client-" + name, name);
    EXPECT_THAT(files, IsOk());
    if (!files.ok()) return nullptr;
    return Client(
        {.cert_file = files->cert_file, .key_file = files->key_file, .ca_file = pki_->ca_file()});
  }

  std::string dir_;
  std::unique_ptr<TestPki> pki_;
  std::unique_ptr<TestPki> other_pki_;
  PemFiles server_files_;
};

TEST_F(TlsTest, WithoutOptionsBothSidesArePlaintext) {
  auto server_credentials = MakeServerCredentials({}, ClientCertPolicy::kRequireAndVerify);
  ASSERT_THAT(server_credentials, IsOk());
  auto server = TestServer::Start(*server_credentials);
  ASSERT_NE(server, nullptr);
  auto client = MakeChannelCredentials({});
  ASSERT_THAT(client, IsOk());
  CallResult result = CheckHealth(server->address(), *client);
  EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_NE(result.security_type, GRPC_TLS_TRANSPORT_SECURITY_TYPE);
}

TEST_F(TlsTest, ServerTlsVerifiedByClient) {
  auto server = StartServer(/*verify_clients=*/false, ClientCertPolicy::kRequestAndVerify);
  ASSERT_NE(server, nullptr);
  CallResult result = CheckHealth(server->address(), Client({.ca_file = pki_->ca_file()}));
  EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.security_type, GRPC_TLS_TRANSPORT_SECURITY_TYPE);
  // The client's auth context carries the server certificate's CN.
  EXPECT_THAT(result.server_name, Optional(std::string("server")));
  // The server asked for no client certificate.
  CallResult node = GetNode(server->address(), Client({.ca_file = pki_->ca_file()}));
  ASSERT_TRUE(node.status.ok()) << node.status.error_message();
  EXPECT_EQ(node.name_seen_by_server, kNoCertificate);
}

TEST_F(TlsTest, PlaintextClientCannotTalkToTlsServer) {
  auto server = StartServer(/*verify_clients=*/false, ClientCertPolicy::kRequestAndVerify);
  ASSERT_NE(server, nullptr);
  CallResult result = CheckHealth(server->address(), grpc::InsecureChannelCredentials());
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ClientTrustingAnotherCaRefusesServer) {
  auto server = StartServer(/*verify_clients=*/false, ClientCertPolicy::kRequestAndVerify);
  ASSERT_NE(server, nullptr);
  CallResult result = CheckHealth(server->address(), Client({.ca_file = other_pki_->ca_file()}));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, ClientChecksServerHostname) {
  auto server = StartServer(/*verify_clients=*/false, ClientCertPolicy::kRequestAndVerify);
  ASSERT_NE(server, nullptr);
  auto client = Client({.ca_file = pki_->ca_file()});
  // The certificate names localhost, 127.0.0.1 and ::1 only.
  grpc::ChannelArguments args = FreshConnectionArgs();
  args.SetSslTargetNameOverride("coordinator.example.com");
  CallResult wrong_name = CheckHealth(server->address(), client, args);
  EXPECT_EQ(wrong_name.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  CallResult by_dns = CheckHealth(
      absl::StrCat("localhost:", server->address().substr(server->address().rfind(':') + 1)),
      client);
  EXPECT_TRUE(by_dns.status.ok()) << by_dns.status.error_message();
}

TEST_F(TlsTest, RequiredClientCertificate) {
  auto server = StartServer(/*verify_clients=*/true, ClientCertPolicy::kRequireAndVerify);
  ASSERT_NE(server, nullptr);

  CallResult no_cert = GetNode(server->address(), Client({.ca_file = pki_->ca_file()}));
  EXPECT_EQ(no_cert.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << no_cert.status.error_message();

  CallResult other_ca = GetNode(server->address(), ClientWithCert(*other_pki_, "mallory"));
  EXPECT_EQ(other_ca.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << other_ca.status.error_message();

  auto expired =
      pki_->Issue("expired", "alice", absl::Now() - absl::Hours(48), absl::Now() - absl::Hours(24));
  ASSERT_THAT(expired, IsOk());
  CallResult expired_cert =
      GetNode(server->address(), UncheckedCredentials(pki_->ca_file(), *expired));
  EXPECT_EQ(expired_cert.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << expired_cert.status.error_message();

  CallResult good = GetNode(server->address(), ClientWithCert(*pki_, "alice"));
  ASSERT_TRUE(good.status.ok()) << good.status.error_message();
  // The server reads the client certificate's CN from its auth context.
  EXPECT_EQ(good.name_seen_by_server, "alice");
}

TEST_F(TlsTest, RequestedClientCertificateIsOptionalButVerified) {
  auto server = StartServer(/*verify_clients=*/true, ClientCertPolicy::kRequestAndVerify);
  ASSERT_NE(server, nullptr);

  CallResult no_cert = GetNode(server->address(), Client({.ca_file = pki_->ca_file()}));
  ASSERT_TRUE(no_cert.status.ok()) << no_cert.status.error_message();
  EXPECT_EQ(no_cert.name_seen_by_server, kNoCertificate);

  CallResult good = GetNode(server->address(), ClientWithCert(*pki_, "bob"));
  ASSERT_TRUE(good.status.ok()) << good.status.error_message();
  EXPECT_EQ(good.name_seen_by_server, "bob");

  CallResult other_ca = GetNode(server->address(), ClientWithCert(*other_pki_, "mallory"));
  EXPECT_EQ(other_ca.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a presented certificate must verify; the server saw " << other_ca.name_seen_by_server;
}

TEST_F(TlsTest, ServerPicksUpRotatedCertificateWithoutRestart) {
  auto a = pki_->Issue("a", "a");
  auto b = pki_->Issue("b", "b");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  const std::string cert_file = dir_ + "/live.crt";
  const std::string key_file = dir_ + "/live.key";
  ReplaceFile(a->cert_file, cert_file);
  ReplaceFile(a->key_file, key_file);
  auto server_credentials = MakeServerCredentials(
      {.cert_file = cert_file, .key_file = key_file, .reload_interval = absl::Seconds(1)},
      ClientCertPolicy::kRequestAndVerify);
  ASSERT_THAT(server_credentials, IsOk());
  auto server = TestServer::Start(*server_credentials);
  ASSERT_NE(server, nullptr);
  auto client = Client({.ca_file = pki_->ca_file()});
  CallResult before = CheckHealth(server->address(), client);
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  EXPECT_THAT(before.server_name, Optional(std::string("a")));

  ReplaceFile(b->cert_file, cert_file);
  ReplaceFile(b->key_file, key_file);
  // Cert and key land one rename apart, so a reload may catch a mismatched
  // pair for one interval; poll until a new connection sees "b".
  CallResult after;
  testing::WaitUntil(
      [&] {
        after = CheckHealth(server->address(), client);
        return after.status.ok() && after.server_name == "b";
      },
      absl::Seconds(10), absl::Milliseconds(250));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_THAT(after.server_name, Optional(std::string("b")));
}

TEST_F(TlsTest, ServerPicksUpRotatedCaWithoutRestart) {
  const std::string ca_file = dir_ + "/live-ca.crt";
  ReplaceFile(pki_->ca_file(), ca_file);
  auto server_credentials = MakeServerCredentials({.cert_file = server_files_.cert_file,
                                                   .key_file = server_files_.key_file,
                                                   .ca_file = ca_file,
                                                   .reload_interval = absl::Seconds(1)},
                                                  ClientCertPolicy::kRequireAndVerify);
  ASSERT_THAT(server_credentials, IsOk());
  auto server = TestServer::Start(*server_credentials);
  ASSERT_NE(server, nullptr);
  // Both clients trust the server's CA; they differ in who issued their own
  // certificate.
  auto old_ca_client = ClientWithCert(*pki_, "old");
  auto new_ca_client = ClientWithCert(*other_pki_, "new");
  ASSERT_TRUE(GetNode(server->address(), old_ca_client).status.ok());
  ASSERT_FALSE(GetNode(server->address(), new_ca_client).status.ok());

  ReplaceFile(other_pki_->ca_file(), ca_file);
  CallResult new_result;
  testing::WaitUntil(
      [&] {
        new_result = GetNode(server->address(), new_ca_client);
        return new_result.status.ok();
      },
      absl::Seconds(10), absl::Milliseconds(250));
  ASSERT_TRUE(new_result.status.ok()) << new_result.status.error_message();
  EXPECT_EQ(new_result.name_seen_by_server, "new");
  EXPECT_EQ(GetNode(server->address(), old_ca_client).status.error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, CheckAcceptsGoodFiles) {
  EXPECT_THAT(CheckTlsFiles({}, /*need_identity=*/true), IsOk());
  EXPECT_THAT(CheckTlsFiles({.cert_file = server_files_.cert_file,
                             .key_file = server_files_.key_file,
                             .ca_file = pki_->ca_file()},
                            /*need_identity=*/true),
              IsOk());
  EXPECT_THAT(CheckTlsFiles({.ca_file = pki_->ca_file()}, /*need_identity=*/false), IsOk());
}

TEST_F(TlsTest, CheckNamesFlagOfMissingFile) {
  EXPECT_THAT(
      CheckTlsFiles({.cert_file = dir_ + "/absent.crt", .key_file = server_files_.key_file}, true),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("--tls_cert"), HasSubstr("absent.crt"))));
  EXPECT_THAT(
      CheckTlsFiles({.cert_file = server_files_.cert_file, .key_file = dir_ + "/absent.key"}, true),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_key")));
  EXPECT_THAT(CheckTlsFiles({.cert_file = server_files_.cert_file,
                             .key_file = server_files_.key_file,
                             .ca_file = dir_ + "/absent-ca.crt"},
                            true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_ca")));
}

TEST_F(TlsTest, CheckNamesMissingCompanionFlag) {
  EXPECT_THAT(CheckTlsFiles({.cert_file = server_files_.cert_file}, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_key")));
  EXPECT_THAT(CheckTlsFiles({.key_file = server_files_.key_file}, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_cert")));
  // A server needs an identity; a client needs a CA to verify the server.
  EXPECT_THAT(CheckTlsFiles({.ca_file = pki_->ca_file()}, /*need_identity=*/true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_cert")));
  EXPECT_THAT(
      CheckTlsFiles({.cert_file = server_files_.cert_file, .key_file = server_files_.key_file},
                    /*need_identity=*/false),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_ca")));
  EXPECT_THAT(MakeServerCredentials(
                  {.cert_file = server_files_.cert_file, .key_file = server_files_.key_file},
                  ClientCertPolicy::kRequireAndVerify),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_ca")));
  EXPECT_THAT(CheckTlsFiles(
                  {.ca_file = pki_->ca_file(), .reload_interval = absl::Milliseconds(500)}, false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_reload_interval")));
}

TEST_F(TlsTest, CheckRefusesKeyOfAnotherCertificate) {
  auto other = pki_->Issue("other", "other");
  ASSERT_THAT(other, IsOk());
  EXPECT_THAT(
      CheckTlsFiles({.cert_file = server_files_.cert_file, .key_file = other->key_file}, true),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("--tls_key"), HasSubstr("does not match"))));
}

TEST_F(TlsTest, CheckRefusesExpiredAndNotYetValidCertificates) {
  auto expired = pki_->Issue("expired", "expired", absl::FromUnixSeconds(1'500'000'000),
                             absl::FromUnixSeconds(1'600'000'000));
  ASSERT_THAT(expired, IsOk());
  EXPECT_THAT(
      CheckTlsFiles({.cert_file = expired->cert_file, .key_file = expired->key_file}, true),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr("--tls_cert"), HasSubstr("expired.crt"), HasSubstr("has expired"),
                     HasSubstr("2017-07-14 02:40:00 UTC"), HasSubstr("2020-09-13 12:26:40 UTC"))));
  auto future =
      pki_->Issue("future", "future", absl::Now() + absl::Hours(24), absl::Now() + absl::Hours(48));
  ASSERT_THAT(future, IsOk());
  EXPECT_THAT(CheckTlsFiles({.cert_file = future->cert_file, .key_file = future->key_file}, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_cert"), HasSubstr("not yet valid"))));
  // The server refuses to start with it.
  EXPECT_THAT(
      MakeServerCredentials({.cert_file = expired->cert_file, .key_file = expired->key_file},
                            ClientCertPolicy::kRequestAndVerify),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has expired")));
}

TEST_F(TlsTest, CheckRefusesGarbage) {
  const std::string garbage = dir_ + "/garbage.pem";
  {
    std::ofstream(garbage) << "-----BEGIN CERTIFICATE-----\nnot base64 at all\n"
                              "-----END CERTIFICATE-----\n";
  }
  EXPECT_THAT(CheckTlsFiles({.cert_file = garbage, .key_file = server_files_.key_file}, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_cert"), HasSubstr("no PEM certificate"))));
  EXPECT_THAT(CheckTlsFiles({.cert_file = server_files_.cert_file, .key_file = garbage}, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_key"), HasSubstr("no unencrypted PEM private key"))));
  EXPECT_THAT(CheckTlsFiles({.ca_file = garbage}, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--tls_ca"), HasSubstr("no PEM certificate"))));
  // A key where the certificate belongs.
  EXPECT_THAT(CheckTlsFiles(
                  {.cert_file = server_files_.key_file, .key_file = server_files_.key_file}, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_cert")));
  EXPECT_THAT(MakeChannelCredentials({.ca_file = garbage}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls_ca")));
}

TEST(IsLoopbackAddressTest, LoopbackOnly) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackAddress("127.3.4.5:0"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:50051"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:50051"));
  EXPECT_TRUE(IsLoopbackAddress("LocalHost:1"));
  EXPECT_TRUE(IsLoopbackAddress("[::ffff:127.0.0.1]:1"));
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackAddress("unix:/run/tessera.sock"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50051"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50051"));
  EXPECT_FALSE(IsLoopbackAddress(":50051"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.5:50051"));
  EXPECT_FALSE(IsLoopbackAddress("128.0.0.1:50051"));
  EXPECT_FALSE(IsLoopbackAddress("[::2]:50051"));
  EXPECT_FALSE(IsLoopbackAddress("localhost.evil.com:50051"));
  EXPECT_FALSE(IsLoopbackAddress("coordinator:50051"));
  EXPECT_FALSE(IsLoopbackAddress(""));
  EXPECT_FALSE(IsLoopbackAddress("[::1"));
}

}  // namespace
}  // namespace tessera
