#include "client/coordinator_client.h"

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/daemon/server.h"
#include "grpcpp/client_context.h"

namespace tessera::client {

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
  // With a setup error the channel points nowhere useful; Annotate returns the error first.
  auto channel = MakeClientChannel(options.address, credentials);
  health_ = grpc::health::v1::Health::NewStub(channel);
  coordinator_ = v1::Coordinator::NewStub(channel);
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

std::unique_ptr<grpc::ClientContext> CoordinatorClient::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.token.empty()) context->AddMetadata("authorization", "Bearer " + options_.token);
  return context;
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> CoordinatorClient::CheckHealth(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = health_->Check(NewContext().get(), request, &response);
  if (!status.ok()) {
    absl::Status error = FromGrpcStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("coordinator at ", options_.address, ": ", error.message()));
  }
  return response.status();
}

absl::StatusOr<v1::Job> CoordinatorClient::Submit(const v1::JobSpec& spec,
                                                  const std::string& request_id) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  request.set_request_id(request_id);
  v1::SubmitJobResponse response;
  if (auto s = Annotate(coordinator_->SubmitJob(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return response.job();
}

absl::StatusOr<v1::Job> CoordinatorClient::Get(const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::GetJobResponse response;
  if (auto s = Annotate(coordinator_->GetJob(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return response.job();
}

absl::StatusOr<v1::ListJobsResponse> CoordinatorClient::List(const v1::ListJobsRequest& request) {
  v1::ListJobsResponse response;
  if (auto s = Annotate(coordinator_->ListJobs(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<v1::Job> CoordinatorClient::Cancel(const std::string& job_id,
                                                  const std::string& reason) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  v1::CancelJobResponse response;
  if (auto s = Annotate(coordinator_->CancelJob(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return response.job();
}

absl::StatusOr<v1::GetMetricsResponse> CoordinatorClient::Metrics(
    const v1::GetMetricsRequest& request) {
  v1::GetMetricsResponse response;
  if (auto s = Annotate(coordinator_->GetMetrics(NewContext().get(), request, &response));
      !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<std::vector<v1::Checkpoint>> CoordinatorClient::Checkpoints(
    const std::string& job_id) {
  v1::ListCheckpointsRequest request;
  request.set_job_id(job_id);
  v1::ListCheckpointsResponse response;
  if (auto s = Annotate(coordinator_->ListCheckpoints(NewContext().get(), request, &response));
      !s.ok()) {
    return s;
  }
  return std::vector<v1::Checkpoint>(response.checkpoints().begin(), response.checkpoints().end());
}

absl::StatusOr<std::vector<v1::Node>> CoordinatorClient::Nodes(bool include_lost) {
  v1::ListNodesRequest request;
  request.set_include_lost(include_lost);
  v1::ListNodesResponse response;
  if (auto s = Annotate(coordinator_->ListNodes(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return std::vector<v1::Node>(response.nodes().begin(), response.nodes().end());
}

absl::StatusOr<v1::ListQueuesResponse> CoordinatorClient::Queues() {
  v1::ListQueuesResponse response;
  if (auto s = Annotate(coordinator_->ListQueues(NewContext().get(), {}, &response)); !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<v1::DrainNodeResponse> CoordinatorClient::DrainNode(
    const v1::DrainNodeRequest& request) {
  v1::DrainNodeResponse response;
  if (auto s = Annotate(coordinator_->DrainNode(NewContext().get(), request, &response)); !s.ok()) {
    return s;
  }
  return response;
}

absl::StatusOr<v1::Node> CoordinatorClient::UndrainNode(const std::string& node_id) {
  v1::UndrainNodeRequest request;
  request.set_node_id(node_id);
  v1::UndrainNodeResponse response;
  if (auto s = Annotate(coordinator_->UndrainNode(NewContext().get(), request, &response));
      !s.ok()) {
    return s;
  }
  return response.node();
}

absl::Status CoordinatorClient::RemoveNode(const std::string& node_id) {
  v1::RemoveNodeRequest request;
  request.set_node_id(node_id);
  v1::RemoveNodeResponse response;
  return Annotate(coordinator_->RemoveNode(NewContext().get(), request, &response));
}

absl::StatusOr<v1::PlanLayoutResponse> CoordinatorClient::Plan(
    const v1::PlanLayoutRequest& request) {
  v1::PlanLayoutResponse response;
  if (auto s = Annotate(coordinator_->PlanLayout(NewContext().get(), request, &response));
      !s.ok()) {
    return s;
  }
  return response;
}

absl::Status CoordinatorClient::Watch(const std::string& job_id, int64_t after_sequence,
                                      const std::function<bool(const v1::JobEvent&)>& on_event) {
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  request.set_after_sequence(after_sequence);
  grpc::ClientContext context;
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
  auto reader = coordinator_->WatchJob(&context, request);
  v1::JobEvent event;
  while (reader->Read(&event)) {
    if (!on_event(event)) {
      context.TryCancel();
      break;
    }
  }
  return Annotate(reader->Finish());
}

absl::Status CoordinatorClient::Logs(const v1::GetLogsRequest& request,
                                     const std::function<void(const v1::LogChunk&)>& on_chunk) {
  grpc::ClientContext context;
  if (!request.follow()) context.set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  if (!options_.token.empty()) context.AddMetadata("authorization", "Bearer " + options_.token);
  auto reader = coordinator_->GetLogs(&context, request);
  v1::LogChunk chunk;
  while (reader->Read(&chunk)) on_chunk(chunk);
  return Annotate(reader->Finish());
}

}  // namespace tessera::client
