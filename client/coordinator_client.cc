#include "client/coordinator_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/daemon/server.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"

namespace tessera::client {
namespace {

// Wait before reopening a watch stream on one coordinator; doubles up to the maximum.
constexpr absl::Duration kWatchInitialBackoff = absl::Milliseconds(100);
constexpr absl::Duration kWatchMaxBackoff = absl::Seconds(2);

}  // namespace

CoordinatorClient::CoordinatorClient(const ClientOptions& options) : options_(options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (options.tls.enabled()) {
    setup_error_ = CheckTlsFiles(options.tls, /*need_identity=*/false);
    if (setup_error_.ok() && options.tls.ca_file.empty()) {
      setup_error_ = absl::InvalidArgumentError(
          "--tls_ca: required with --tls_cert/--tls_key (the CA that signed the coordinator)");
    }
    if (setup_error_.ok()) {
      auto made = MakeChannelCredentials(options.tls);
      if (made.ok()) {
        credentials = std::move(*made);
      } else {
        setup_error_ = made.status();
      }
    }
  }
  absl::StatusOr<std::vector<std::string>> addresses =
      ParseCoordinatorAddresses(options.address, "--coordinator");
  if (!addresses.ok() && setup_error_.ok()) setup_error_ = addresses.status();
  // With a setup error the channel points nowhere useful; Annotate returns the error first.
  leader_ = std::make_unique<LeaderChannel>(LeaderChannelOptions{
      .addresses = addresses.ok() ? *addresses : std::vector<std::string>{options.address},
      .credentials = std::move(credentials)});
}

void CoordinatorClient::Authorize(grpc::ClientContext& context) const {
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
}

absl::Status CoordinatorClient::Unary(
    const std::function<grpc::Status(v1::Coordinator::Stub&, grpc::ClientContext&)>& call) {
  if (!setup_error_.ok()) return setup_error_;
  const absl::Time deadline = absl::Now() + options_.timeout;
  return Annotate(leader_->CallService<v1::Coordinator>(
      deadline, [&](grpc::ClientContext& context) { Authorize(context); }, call));
}

absl::Status CoordinatorClient::Annotate(const grpc::Status& status) const {
  if (!setup_error_.ok()) return setup_error_;
  if (status.ok()) return absl::OkStatus();
  absl::Status error = FromGrpcStatus(status);
  // Unreachable: say where we looked. Otherwise the coordinator's message
  // already says what is wrong.
  if (error.code() == absl::StatusCode::kUnavailable ||
      error.code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(error.code(),
                        absl::StrCat("coordinator at ", options_.address, ": ", error.message()));
  }
  return error;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CoordinatorClient::CheckHealth(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (!setup_error_.ok()) return setup_error_;
  // The health service answers on standbys too (their readiness is NOT_SERVING): it asks the
  // coordinator calls go to now, following a leader hint but no further.
  std::string answered;
  grpc::Status status = leader_->Call(
      absl::InfinitePast(),
      [&](grpc::ClientContext& context) {
        context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
        Authorize(context);
      },
      [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& channel,
          const std::string& address) {
        answered = address;
        return grpc::health::v1::Health::NewStub(channel)->Check(&context, request, &response);
      });
  if (!status.ok()) {
    absl::Status error = FromGrpcStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("coordinator at ", answered, ": ", error.message()));
  }
  return response.status();
}

absl::StatusOr<v1::Job> CoordinatorClient::Submit(const v1::JobSpec& spec,
                                                  const std::string& request_id) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  request.set_request_id(request_id);
  v1::SubmitJobResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.SubmitJob(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response.job();
}

absl::StatusOr<v1::Job> CoordinatorClient::Get(const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::GetJobResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.GetJob(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response.job();
}

absl::StatusOr<v1::ListJobsResponse> CoordinatorClient::List(const v1::ListJobsRequest& request) {
  v1::ListJobsResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.ListJobs(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::Job> CoordinatorClient::Cancel(const std::string& job_id,
                                                  const std::string& reason) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  v1::CancelJobResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.CancelJob(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response.job();
}

absl::StatusOr<v1::GetMetricsResponse> CoordinatorClient::Metrics(
    const v1::GetMetricsRequest& request) {
  v1::GetMetricsResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.GetMetrics(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<std::vector<v1::Checkpoint>> CoordinatorClient::Checkpoints(
    const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  v1::ListCheckpointsResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.ListCheckpoints(&context, request, &response);
  });
  if (!status.ok()) return status;
  return std::vector<v1::Checkpoint>(response.checkpoints().begin(), response.checkpoints().end());
}

absl::StatusOr<v1::ListNodesResponse> CoordinatorClient::ListNodes(bool include_lost) {
  v1::ListNodesRequest request;
  request.set_include_lost(include_lost);
  v1::ListNodesResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.ListNodes(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<std::vector<v1::Node>> CoordinatorClient::Nodes(bool include_lost) {
  ASSIGN_OR_RETURN(v1::ListNodesResponse response, ListNodes(include_lost));
  return std::vector<v1::Node>(response.nodes().begin(), response.nodes().end());
}

absl::StatusOr<v1::ListQueuesResponse> CoordinatorClient::Queues() {
  v1::ListQueuesResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.ListQueues(&context, v1::ListQueuesRequest(), &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::DrainNodeResponse> CoordinatorClient::DrainNode(
    const v1::DrainNodeRequest& request) {
  v1::DrainNodeResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.DrainNode(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::Node> CoordinatorClient::UndrainNode(const std::string& node_id) {
  v1::UndrainNodeRequest request;
  request.set_node_id(node_id);
  v1::UndrainNodeResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.UndrainNode(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response.node();
}

absl::Status CoordinatorClient::RemoveNode(const std::string& node_id) {
  v1::RemoveNodeRequest request;
  request.set_node_id(node_id);
  v1::RemoveNodeResponse response;
  return Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.RemoveNode(&context, request, &response);
  });
}

absl::StatusOr<v1::PlanLayoutResponse> CoordinatorClient::Plan(
    const v1::PlanLayoutRequest& request) {
  v1::PlanLayoutResponse response;
  absl::Status status = Unary([&](v1::Coordinator::Stub& stub, grpc::ClientContext& context) {
    return stub.PlanLayout(&context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::Status CoordinatorClient::Watch(const std::string& job_id, int64_t after_sequence,
                                      const std::function<bool(const v1::JobEvent&)>& on_event) {
  if (!setup_error_.ok()) return setup_error_;
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  // The last sequence delivered: a reopened stream starts after it, and an event the coordinator
  // sends again (at or below it) is dropped.
  int64_t delivered = after_sequence;
  // When the stream last delivered an event or opened: reconnect_timeout counts from there.
  absl::Time progress = absl::Now();
  bool stopped = false;
  absl::Duration backoff = kWatchInitialBackoff;
  while (true) {
    grpc::Status status = leader_->Call(
        [&] { return progress + options_.reconnect_timeout; },
        [&](grpc::ClientContext& context) { Authorize(context); },
        [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& channel,
            const std::string&) {
          request.set_after_sequence(delivered);
          std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader =
              v1::Coordinator::NewStub(channel)->WatchJob(&context, request);
          v1::JobEvent event;
          while (reader->Read(&event)) {
            progress = absl::Now();
            backoff = kWatchInitialBackoff;
            if (event.sequence() > 0 && event.sequence() <= delivered) continue;
            delivered = std::max(delivered, event.sequence());
            if (!on_event(event)) {
              stopped = true;
              context.TryCancel();
              break;
            }
          }
          grpc::Status finished = reader->Finish();
          if (stopped) return grpc::Status(grpc::StatusCode::CANCELLED, "stopped by the caller");
          // A coordinator shutting down cancels its streams: as good as dropped.
          if (finished.error_code() == grpc::StatusCode::CANCELLED) {
            return grpc::Status(grpc::StatusCode::UNAVAILABLE, finished.error_message());
          }
          return finished;
        });
    if (stopped) return absl::CancelledError("watch stopped");
    // One coordinator makes one attempt per Call: this loop waits and reopens until the deadline.
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        absl::Now() >= progress + options_.reconnect_timeout) {
      return Annotate(status);
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, kWatchMaxBackoff);
  }
}

absl::Status CoordinatorClient::Logs(const v1::GetLogsRequest& request,
                                     const std::function<void(const v1::LogChunk&)>& on_chunk) {
  if (!setup_error_.ok()) return setup_error_;
  // Failover when the stream opens only: a followed log that drops is not resumed (its chunks
  // carry no position to resume from).
  bool received = false;
  grpc::Status status = leader_->Call(
      absl::Now() + options_.timeout,
      [&](grpc::ClientContext& context) {
        if (!request.follow()) {
          context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
        }
        Authorize(context);
      },
      [&](grpc::ClientContext& context, const std::shared_ptr<grpc::Channel>& channel,
          const std::string&) {
        std::unique_ptr<grpc::ClientReader<v1::LogChunk>> reader =
            v1::Coordinator::NewStub(channel)->GetLogs(&context, request);
        v1::LogChunk chunk;
        while (reader->Read(&chunk)) {
          received = true;
          on_chunk(chunk);
        }
        grpc::Status finished = reader->Finish();
        // Chunks already printed must not be printed again by a retry elsewhere.
        if (received && finished.error_code() == grpc::StatusCode::UNAVAILABLE) {
          return grpc::Status(grpc::StatusCode::ABORTED,
                              "log stream dropped: " + finished.error_message());
        }
        return finished;
      });
  return Annotate(status);
}

}  // namespace tessera::client
