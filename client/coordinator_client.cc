#include "client/coordinator_client.h"

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/daemon/server.h"
#include "grpcpp/client_context.h"

namespace tessera::client {

CoordinatorClient::CoordinatorClient(const ClientOptions& options) : options_(options) {
  auto channel = MakeClientChannel(options.address);
  health_ = grpc::health::v1::Health::NewStub(channel);
  coordinator_ = v1::Coordinator::NewStub(channel);
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CoordinatorClient::CheckHealth(
    const std::string& service) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health_->Check(&context, request, &response);
  if (!status.ok()) {
    absl::Status error = FromGrpcStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("coordinator at ", options_.address, ": ", error.message()));
  }
  return response.status();
}

}  // namespace tessera::client
