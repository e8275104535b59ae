// The leader's per-call check (leader_guard.h) on a real in-process gRPC server: while the
// leadership is valid a call is answered as the service answers it; once it is not, the same
// call fails UNAVAILABLE naming the coordinator, and health checks are untouched.
//
// Thread safety: the flag is atomic; gRPC's threads read it.
#include "coordinator/ha/leader_guard.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/daemon/server.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::coordinator {
namespace {

using ::testing::HasSubstr;

// Answers GetJob with the asked id.
class EchoJobs final : public v1::Coordinator::CallbackService {
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::GetJobResponse* response) override {
    response->mutable_job()->set_job_id(request->job_id());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(LeaderGuardTest, CallsFailUnavailableOnlyWhileTheLeadershipIsNotValid) {
  std::atomic<bool> leading{true};
  EchoJobs service;
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(
      MakeLeadershipInterceptorFactory([&leading] { return leading.load(); }, "10.0.0.1:50051"));
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0"},
                                  {{v1::Coordinator::service_full_name(), &service}},
                                  std::move(interceptors));
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = (*server)->InProcessChannel();
  auto stub = v1::Coordinator::NewStub(channel);
  auto get = [&](v1::GetJobResponse* response) {
    v1::GetJobRequest request;
    request.set_job_id("job-00000001");
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return stub->GetJob(&context, request, response);
  };
  auto health = [&] {
    auto health_stub = grpc::health::v1::Health::NewStub(channel);
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return health_stub->Check(&context, request, &response);
  };

  v1::GetJobResponse answered;
  grpc::Status status = get(&answered);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(answered.job().job_id(), "job-00000001");

  leading = false;
  status = get(&answered);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("coordinator 10.0.0.1:50051 lost leadership"));
  EXPECT_TRUE(health().ok()) << "health is the process's, not the leadership's";

  leading = true;
  EXPECT_TRUE(get(&answered).ok());
  (*server)->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace tessera::coordinator
