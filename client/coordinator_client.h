// CoordinatorClient: the C++ client library the `tessera` CLI is built on.
// Synchronous stubs, a deadline on every call, errors as absl::Status.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::client {

struct ClientOptions {
  // Coordinator address, host:port.
  std::string address = "127.0.0.1:50051";
  // Deadline of each unary call.
  absl::Duration timeout = absl::Seconds(10);
};

// Thread safety: the methods may be called from several threads at once.
class CoordinatorClient {
 public:
  explicit CoordinatorClient(const ClientOptions& options);

  // The coordinator's grpc.health.v1 status for `service` ("" = the server).
  // UNAVAILABLE with the address when nothing answers.
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      const std::string& service = "");

  const ClientOptions& options() const { return options_; }

 private:
  ClientOptions options_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
};

}  // namespace tessera::client
