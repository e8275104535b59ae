// CoordinatorClient: the C++ client library the `tessera` CLI is built on.
// Synchronous stubs, a deadline on every unary call, errors as absl::Status
// whose message names the coordinator.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/security/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::client {

struct ClientOptions {
  // Coordinator address, host:port.
  std::string address = "127.0.0.1:50051";
  // Deadline of each unary call.
  absl::Duration timeout = absl::Seconds(10);
  // Bearer token sent with every call; empty: none.
  std::string token{};
  // TLS: CA verifying the coordinator, and an optional client certificate.
  // Disabled when all are empty (plaintext).
  TlsOptions tls{};
};

// Thread safety: the methods may be called from several threads at once.
class CoordinatorClient {
 public:
  // TLS files that cannot be used (e.g. a --tls_cert without --tls_ca) surface as the first
  // call's INVALID_ARGUMENT.
  explicit CoordinatorClient(const ClientOptions& options);

  // The coordinator's grpc.health.v1 status for `service` ("" = the server).
  // UNAVAILABLE with the address when nothing answers.
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CheckHealth(
      const std::string& service = "");

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, const std::string& request_id = "");
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  absl::StatusOr<v1::ListJobsResponse> List(const v1::ListJobsRequest& request);
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason);
  absl::StatusOr<v1::GetMetricsResponse> Metrics(const v1::GetMetricsRequest& request);
  absl::StatusOr<std::vector<v1::Checkpoint>> Checkpoints(const std::string& job_id);
  absl::StatusOr<std::vector<v1::Node>> Nodes(bool include_lost);
  absl::StatusOr<v1::ListQueuesResponse> Queues();
  // Node operations (admin role).
  absl::StatusOr<v1::DrainNodeResponse> DrainNode(const v1::DrainNodeRequest& request);
  absl::StatusOr<v1::Node> UndrainNode(const std::string& node_id);
  absl::Status RemoveNode(const std::string& node_id);
  absl::StatusOr<v1::PlanLayoutResponse> Plan(const v1::PlanLayoutRequest& request);
  // Streams the job's events after `after_sequence` to `on_event` until the
  // job is terminal (OK) or `on_event` returns false (CANCELLED). No deadline.
  absl::Status Watch(const std::string& job_id, int64_t after_sequence,
                     const std::function<bool(const v1::JobEvent&)>& on_event);
  // Streams trainer logs to `on_chunk`.
  absl::Status Logs(const v1::GetLogsRequest& request,
                    const std::function<void(const v1::LogChunk&)>& on_chunk);

  const ClientOptions& options() const { return options_; }

 private:
  absl::Status Annotate(const grpc::Status& status) const;
  std::unique_ptr<grpc::ClientContext> NewContext() const;

  ClientOptions options_;
  // Why the channel could not be made; every call returns it.
  absl::Status setup_error_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<v1::Coordinator::Stub> coordinator_;
};

}  // namespace tessera::client
