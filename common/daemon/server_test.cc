// Serves a real service on 127.0.0.1 port 0 and calls it over TCP, plus the
// health service and the metrics endpoint every daemon carries.

#include "common/daemon/server.h"

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/daemon/metrics_exposer.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "tessera/v1/worker_service.grpc.pb.h"
#include "tests/util/grpc_context.h"
#include "tests/util/http_get.h"

namespace tessera {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::tessera::testing::ContextWithDeadline;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::HasSubstr;

// A Worker service that answers GetNode with a fixed hostname, and counts calls.
class FakeWorkerService final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* request,
                                    v1::GetNodeResponse* response) override {
    ++calls_;
    response->mutable_node()->set_hostname("node-under-test");
    response->mutable_node()->mutable_resources()->set_cpu_slots(3);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  int calls() const { return calls_; }

 private:
  std::atomic<int> calls_{0};
};

// A Worker service whose GetNode answers only when the test says so.
class HoldingWorkerService final : public v1::Worker::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* request,
                                    v1::GetNodeResponse* response) override {
    absl::MutexLock lock(&mu_);
    reactor_ = context->DefaultReactor();
    received_.Notify();
    return reactor_;
  }
  void WaitForCall() { received_.WaitForNotification(); }
  void Answer() {
    absl::MutexLock lock(&mu_);
    reactor_->Finish(grpc::Status::OK);
  }

 private:
  absl::Mutex mu_;
  grpc::ServerUnaryReactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Notification received_;
};

class GrpcServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                    {{v1::Worker::service_full_name(), &service_}});
    ASSERT_THAT(server, IsOk());
    server_ = std::move(*server);
  }

  FakeWorkerService service_;
  std::unique_ptr<GrpcServer> server_;
};

TEST_F(GrpcServerTest, BindsAPortAndAnswersOverTcp) {
  ASSERT_GT(server_->port(), 0);
  EXPECT_EQ(server_->address(), absl::StrCat("127.0.0.1:", server_->port()));

  auto stub = v1::Worker::NewStub(MakeClientChannel(server_->address()));
  v1::GetNodeResponse response;
  grpc::Status status = stub->GetNode(ContextWithDeadline().get(), {}, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.node().hostname(), "node-under-test");
  EXPECT_EQ(response.node().resources().cpu_slots(), 3);
  EXPECT_EQ(service_.calls(), 1);
}

TEST_F(GrpcServerTest, UnimplementedMethodsSayUnimplemented) {
  auto stub = v1::Worker::NewStub(MakeClientChannel(server_->address()));
  auto context = ContextWithDeadline();
  auto reader = stub->ReadLogs(context.get(), v1::ReadLogsRequest());
  v1::LogChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(GrpcServerTest, HealthReportsTheServerAndEachService) {
  auto health = Health::NewStub(MakeClientChannel(server_->address()));
  for (const std::string service : {"", "tessera.v1.Worker"}) {
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    grpc::Status status = health->Check(ContextWithDeadline().get(), request, &response);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING) << service;
  }
  HealthCheckRequest unknown;
  unknown.set_service("tessera.v1.NoSuchService");
  HealthCheckResponse response;
  EXPECT_EQ(health->Check(ContextWithDeadline().get(), unknown, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(GrpcServerTest, InProcessChannelReachesTheSameService) {
  auto stub = v1::Worker::NewStub(server_->InProcessChannel());
  v1::GetNodeResponse response;
  ASSERT_TRUE(stub->GetNode(ContextWithDeadline().get(), {}, &response).ok());
  EXPECT_EQ(response.node().hostname(), "node-under-test");
}

TEST_F(GrpcServerTest, ABusyPortIsUnavailableNotACrash) {
  FakeWorkerService other;
  auto second = GrpcServer::Start({.listen_address = server_->address()},
                                  {{v1::Worker::service_full_name(), &other}});
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot listen")));
}

TEST_F(GrpcServerTest, ShutdownStopsServingAndIsIdempotent) {
  std::string address = server_->address();
  server_->Shutdown(absl::Milliseconds(100));
  server_->Shutdown();
  auto stub = v1::Worker::NewStub(MakeClientChannel(address));
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  v1::GetNodeResponse response;
  EXPECT_FALSE(stub->GetNode(context.get(), {}, &response).ok());
}

TEST(MetricsExposerTest, ServesBuildInfoAndRegisteredMetrics) {
  auto exposer = MetricsExposer::Start({.listen_address = "127.0.0.1:0", .component = "test"});
  ASSERT_THAT(exposer, IsOk());
  ASSERT_GT((*exposer)->port(), 0);
  prometheus::BuildCounter()
      .Name("tessera_test_events_total")
      .Help("events seen by the test")
      .Register((*exposer)->registry())
      .Add({})
      .Increment(3);

  auto response = testing::HttpGet((*exposer)->port(), "/metrics");
  ASSERT_THAT(response, IsOk());
  EXPECT_EQ(response->status_code, 200);
  EXPECT_THAT(response->body, HasSubstr("tessera_build_info{"));
  EXPECT_THAT(response->body, HasSubstr("component=\"test\""));
  EXPECT_THAT(response->body, HasSubstr("tessera_test_events_total 3"));
}

TEST(MetricsExposerTest, ABadAddressIsUnavailable) {
  auto exposer = MetricsExposer::Start({.listen_address = "256.1.1.1:99999", .component = "t"});
  EXPECT_THAT(exposer, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot serve")));
}

// Shutdown closes idle connections early (GrpcServer::kQuietBeforeClosing), never a call in
// flight: that one has the whole grace.
TEST(GrpcServerShutdownTest, ACallInFlightFinishesWithinTheGrace) {
  HoldingWorkerService service;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                  {{v1::Worker::service_full_name(), &service}});
  ASSERT_THAT(server, IsOk());
  auto stub = v1::Worker::NewStub(MakeClientChannel((*server)->address()));
  grpc::Status status;
  absl::Notification answered;
  std::thread caller([&] {
    v1::GetNodeResponse response;
    status = stub->GetNode(ContextWithDeadline(30).get(), {}, &response);
    answered.Notify();
  });
  service.WaitForCall();
  absl::Notification shut;
  std::thread stopper([&] {
    (*server)->Shutdown(absl::Seconds(20));
    shut.Notify();
  });
  EXPECT_FALSE(answered.WaitForNotificationWithTimeout(5 * GrpcServer::kQuietBeforeClosing));
  EXPECT_FALSE(shut.HasBeenNotified());
  service.Answer();
  caller.join();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(shut.WaitForNotificationWithTimeout(absl::Seconds(10)));
  stopper.join();
}

}  // namespace
}  // namespace tessera
