// NodeService: tessera.v1.NodeService (the worker-facing API) over gRPC's
// callback API; converts messages and calls Cluster.
#pragma once

#include "coordinator/cluster.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

// Thread safety: handlers run on gRPC threads and share only the Cluster.
class NodeService final : public v1::NodeService::CallbackService {
 public:
  explicit NodeService(Cluster* cluster) : cluster_(cluster) {}

  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* context,
                                         const v1::RegisterNodeRequest* request,
                                         v1::RegisterNodeResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Report(grpc::CallbackServerContext* context,
                                   const v1::ReportRequest* request,
                                   v1::ReportResponse* response) override;

 private:
  Cluster* cluster_;
};

}  // namespace tessera::coordinator
