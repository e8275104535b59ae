// NodeService: tessera.v1.NodeService (the worker-facing API) over gRPC's
// callback API; converts messages and calls Cluster. Only callers with the
// node role (a join token or a node certificate, see auth.h) get through.
// WatchAssignments streams hold no thread: each is a reactor subscribed to the
// AssignmentNotifier, with at most one write in flight and one notice pending.
#pragma once

#include "common/daemon/call_executor.h"
#include "coordinator/assignment_notifier.h"
#include "coordinator/auth.h"
#include "coordinator/cluster.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

// Thread safety: handlers run on gRPC's threads and the executor's, and share
// only the Cluster, the Authenticator and the AssignmentNotifier, all thread-safe.
class NodeService final : public v1::NodeService::CallbackService {
 public:
  // `authenticator` may be null: open (in-process tests). `notifier` may be
  // null: WatchAssignments answers UNIMPLEMENTED and workers rely on heartbeats.
  // RegisterNode and Report run on `executor` (null: on gRPC's threads): they
  // wait for store commits. Heartbeats stay on gRPC's threads: they never wait
  // for the store.
  explicit NodeService(Cluster* cluster, Authenticator* authenticator = nullptr,
                       AssignmentNotifier* notifier = nullptr, CallExecutor* executor = nullptr)
      : cluster_(cluster),
        authenticator_(authenticator),
        notifier_(notifier),
        executor_(executor) {}

  grpc::ServerUnaryReactor* RegisterNode(grpc::CallbackServerContext* context,
                                         const v1::RegisterNodeRequest* request,
                                         v1::RegisterNodeResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Report(grpc::CallbackServerContext* context,
                                   const v1::ReportRequest* request,
                                   v1::ReportResponse* response) override;
  grpc::ServerWriteReactor<v1::AssignmentsNotice>* WatchAssignments(
      grpc::CallbackServerContext* context, const v1::WatchAssignmentsRequest* request) override;

 private:
  // Admits the caller (node role), then runs `call` (absl::StatusOr<Response>()) on `executor`
  // (null: inline) and finishes the call with its result.
  template <typename Response, typename Call>
  grpc::ServerUnaryReactor* Serve(CallExecutor* executor, grpc::CallbackServerContext* context,
                                  Response* response, Call call);

  Cluster* cluster_;
  Authenticator* authenticator_;
  AssignmentNotifier* notifier_;
  CallExecutor* executor_;
};

}  // namespace tessera::coordinator
