#include "coordinator/node_service.h"

#include "common/daemon/grpc_status.h"
#include "coordinator/coordinator_service.h"

namespace tessera::coordinator {
namespace {

template <typename Response>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context,
                                absl::StatusOr<Response> result, Response* response) {
  if (result.ok()) *response = std::move(*result);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

}  // namespace

grpc::ServerUnaryReactor* NodeService::RegisterNode(grpc::CallbackServerContext* context,
                                                    const v1::RegisterNodeRequest* request,
                                                    v1::RegisterNodeResponse* response) {
  if (auto principal = AdmitCall(authenticator_, *context, Action::kNode); !principal.ok()) {
    return Reply(context, decltype(cluster_->Register(*request))(principal.status()), response);
  }
  return Reply(context, cluster_->Register(*request), response);
}

grpc::ServerUnaryReactor* NodeService::Heartbeat(grpc::CallbackServerContext* context,
                                                 const v1::HeartbeatRequest* request,
                                                 v1::HeartbeatResponse* response) {
  if (auto principal = AdmitCall(authenticator_, *context, Action::kNode); !principal.ok()) {
    return Reply(context, decltype(cluster_->Heartbeat(*request))(principal.status()), response);
  }
  return Reply(context, cluster_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* NodeService::Report(grpc::CallbackServerContext* context,
                                              const v1::ReportRequest* request,
                                              v1::ReportResponse* response) {
  if (auto principal = AdmitCall(authenticator_, *context, Action::kNode); !principal.ok()) {
    return Reply(context, decltype(cluster_->Report(*request))(principal.status()), response);
  }
  return Reply(context, cluster_->Report(*request), response);
}

}  // namespace tessera::coordinator
