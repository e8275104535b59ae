#include "coordinator/node_service.h"

#include "common/daemon/grpc_status.h"

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
  return Reply(context, cluster_->Register(*request), response);
}

grpc::ServerUnaryReactor* NodeService::Heartbeat(grpc::CallbackServerContext* context,
                                                 const v1::HeartbeatRequest* request,
                                                 v1::HeartbeatResponse* response) {
  return Reply(context, cluster_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* NodeService::Report(grpc::CallbackServerContext* context,
                                              const v1::ReportRequest* request,
                                              v1::ReportResponse* response) {
  return Reply(context, cluster_->Report(*request), response);
}

}  // namespace tessera::coordinator
