// CoordinatorClient: the C++ client library the `tessera` CLI is built on.
// Synchronous stubs, a deadline on every unary call, errors as absl::Status
// whose message names the coordinator. Several coordinator addresses (an HA
// control plane) are followed to the leader (common/daemon/leader_channel.h),
// and Watch resumes a dropped stream from the last event it delivered.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/daemon/leader_channel.h"
#include "common/security/tls.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::client {

struct ClientOptions {
  // Coordinator address, host:port, or several, comma-separated: calls go to the one that leads.
  std::string address = "127.0.0.1:50051";
  // Deadline of each unary call (failing over between coordinators included).
  absl::Duration timeout = absl::Seconds(10);
  // How long Watch keeps trying to reopen a dropped stream (a coordinator failing over) since it
  // last received an event or opened a stream, before it gives up.
  absl::Duration reconnect_timeout = absl::Seconds(60);
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
  // The whole ListNodes answer: the nodes and the topology's levels and domains.
  absl::StatusOr<v1::ListNodesResponse> ListNodes(bool include_lost);
  absl::StatusOr<v1::ListQueuesResponse> Queues();
  // Node operations (admin role).
  absl::StatusOr<v1::DrainNodeResponse> DrainNode(const v1::DrainNodeRequest& request);
  absl::StatusOr<v1::Node> UndrainNode(const std::string& node_id);
  absl::Status RemoveNode(const std::string& node_id);
  absl::StatusOr<v1::PlanLayoutResponse> Plan(const v1::PlanLayoutRequest& request);
  // Streams the job's events after `after_sequence` to `on_event` until the
  // job is terminal (OK) or `on_event` returns false (CANCELLED). No deadline.
  // A stream that drops (UNAVAILABLE: a coordinator gone, a leader stepping
  // down) is reopened on the leader after the last event delivered, within
  // reconnect_timeout: each event reaches `on_event` once, in order.
  absl::Status Watch(const std::string& job_id, int64_t after_sequence,
                     const std::function<bool(const v1::JobEvent&)>& on_event);
  // Streams trainer logs to `on_chunk`.
  absl::Status Logs(const v1::GetLogsRequest& request,
                    const std::function<void(const v1::LogChunk&)>& on_chunk);

  const ClientOptions& options() const { return options_; }

 private:
  absl::Status Annotate(const grpc::Status& status) const;
  // Adds the bearer token, if any.
  void Authorize(grpc::ClientContext& context) const;
  // One unary Coordinator call on the leader, failing over within options_.timeout; `call` gets
  // a stub of the address being tried and a prepared context.
  absl::Status Unary(
      const std::function<grpc::Status(v1::Coordinator::Stub&, grpc::ClientContext&)>& call);

  ClientOptions options_;
  // Why the channel could not be made; every call returns it.
  absl::Status setup_error_;
  std::unique_ptr<LeaderChannel> leader_;
};

}  // namespace tessera::client
