// The health-only port of DaemonServers: it mirrors the main port's health statuses (what a
// kubelet's plaintext grpc probe reads while the main port speaks TLS) and serves nothing else.

#include "common/daemon/daemon_servers.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/grpc_context.h"

namespace tessera {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::tessera::testing::ContextWithDeadline;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kWorker[] = "tessera.v1.Worker";

// A daemon on 127.0.0.1 port 0 without metrics, its health-only port at `health_listen`.
DaemonServerOptions Options(const std::string& health_listen) {
  DaemonServerOptions options;
  options.component = "test";
  options.listen_address = "127.0.0.1:0";
  options.health_listen_address = health_listen;
  return options;
}

// Answers GetNode, so that an UNIMPLEMENTED on the health port means the port, not the service.
class FakeWorkerService final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* request,
                                    v1::GetNodeResponse* response) override {
    response->mutable_node()->set_hostname("node-under-test");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

class DaemonServersHealthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto servers = DaemonServers::Start(
        Options("127.0.0.1:0"), {{.name = kWorker, .service = &service_, .serving_at_start = false}});
    ASSERT_THAT(servers, IsOk());
    servers_ = std::move(*servers);
    main_ = MakeClientChannel(servers_->address());
    health_ = MakeClientChannel(absl::StrCat("127.0.0.1:", servers_->health_port()));
  }

  // The status `channel`'s health service reports for `service`.
  static HealthCheckResponse::ServingStatus Status(const std::shared_ptr<grpc::Channel>& channel,
                                                   const std::string& service) {
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status =
        Health::NewStub(channel)->Check(ContextWithDeadline().get(), request, &response);
    EXPECT_TRUE(status.ok()) << service << ": " << status.error_message();
    return response.status();
  }

  // A list_services request of server reflection (grpc.reflection.v1alpha), sent as one message;
  // the status the server ends the stream with.
  static grpc::Status ListServices(const std::shared_ptr<grpc::Channel>& channel) {
    // ServerReflectionRequest{list_services: "*"}: field 7, length-delimited.
    const std::string bytes("\x3a\x01*", 3);
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::GenericStub stub(channel);
    auto context = ContextWithDeadline();
    absl::Notification done;
    grpc::Status result;
    stub.UnaryCall(context.get(),
                   "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                   grpc::StubOptions(), &request, &response, [&](grpc::Status status) {
                     result = std::move(status);
                     done.Notify();
                   });
    done.WaitForNotification();
    return result;
  }

  FakeWorkerService service_;
  std::unique_ptr<DaemonServers> servers_;
  std::shared_ptr<grpc::Channel> main_;
  std::shared_ptr<grpc::Channel> health_;
};

TEST_F(DaemonServersHealthTest, TheHealthPortIsAPortOfItsOwn) {
  EXPECT_GT(servers_->health_port(), 0);
  EXPECT_NE(absl::StrCat("127.0.0.1:", servers_->health_port()), servers_->address());
}

TEST_F(DaemonServersHealthTest, StartsWithTheMainPortsStatuses) {
  for (const auto& channel : {main_, health_}) {
    EXPECT_EQ(Status(channel, ""), HealthCheckResponse::SERVING);
    EXPECT_EQ(Status(channel, kWorker), HealthCheckResponse::NOT_SERVING);
  }
}

TEST_F(DaemonServersHealthTest, SetServingShowsOnBothPorts) {
  servers_->SetServing(kWorker, true);
  EXPECT_EQ(Status(main_, kWorker), HealthCheckResponse::SERVING);
  EXPECT_EQ(Status(health_, kWorker), HealthCheckResponse::SERVING);
  servers_->SetServing(kWorker, false);
  EXPECT_EQ(Status(main_, kWorker), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Status(health_, kWorker), HealthCheckResponse::NOT_SERVING);
  // A name the daemon was not started with (a readiness the daemon sets later) too.
  servers_->SetServing("tessera.v1.Coordinator", true);
  EXPECT_EQ(Status(health_, "tessera.v1.Coordinator"), HealthCheckResponse::SERVING);
}

TEST_F(DaemonServersHealthTest, TheHealthPortServesNoOtherService) {
  v1::GetNodeResponse response;
  ASSERT_TRUE(v1::Worker::NewStub(main_)->GetNode(ContextWithDeadline().get(), {}, &response).ok());
  EXPECT_EQ(response.node().hostname(), "node-under-test");
  EXPECT_EQ(v1::Worker::NewStub(health_)
                ->GetNode(ContextWithDeadline().get(), {}, &response)
                .error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // Reflection answers on the main port only.
  grpc::Status on_main = ListServices(main_);
  EXPECT_TRUE(on_main.ok()) << on_main.error_message();
  EXPECT_EQ(ListServices(health_).error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(DaemonServersHealthTest, ShutdownClosesTheHealthPort) {
  servers_->SetServing(kWorker, true);
  servers_->Shutdown(absl::Milliseconds(100));
  // Idempotent, and SetServing after it is a no-op rather than a crash.
  servers_->Shutdown();
  servers_->SetServing(kWorker, true);
  HealthCheckRequest request;
  HealthCheckResponse response;
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  EXPECT_FALSE(Health::NewStub(health_)->Check(context.get(), request, &response).ok());
}

TEST(DaemonServersTest, NoHealthPortUnlessAsked) {
  FakeWorkerService service;
  auto servers = DaemonServers::Start(Options(""), {{.name = kWorker, .service = &service}});
  ASSERT_THAT(servers, IsOk());
  EXPECT_EQ((*servers)->health_port(), 0);
}

TEST(DaemonServersTest, ABusyHealthPortIsUnavailableNamingTheFlag) {
  FakeWorkerService service;
  auto first = DaemonServers::Start(Options("127.0.0.1:0"), {{.name = kWorker, .service = &service}});
  ASSERT_THAT(first, IsOk());
  auto second =
      DaemonServers::Start(Options(absl::StrCat("127.0.0.1:", (*first)->health_port())),
                           {{.name = kWorker, .service = &service}});
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("--health_listen")));
}

}  // namespace
}  // namespace tessera
