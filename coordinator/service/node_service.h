// NodeService: tessera.v1.NodeService (the worker-facing API); converts
// messages and calls Cluster. Only callers with the node role (a join token or
// a node certificate, see auth.h) get through.
//
// RegisterNode, Heartbeat and Report are on gRPC's callback API.
// WatchAssignments is on the asynchronous API, on completion queues of its
// own: every worker holds one such stream open, and each open call keeps a tag
// outstanding on its queue. The Debian build of gRPC checks every completed
// operation against its queue's outstanding tags by a linear search under the
// queue's lock, so 10,000 streams on the callback API's single shared queue
// made every heartbeat's operations scan 10,000 tags there (a quarter of the
// coordinator's CPU at 10,000 nodes, serialized). A stream holds no thread:
// it is subscribed to the AssignmentNotifier, with at most one write in flight
// and one notice pending.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/daemon/call_executor.h"
#include "common/daemon/server.h"
#include "coordinator/auth/auth.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

// Thread safety: handlers run on gRPC's threads and the executor's, and share
// only the Cluster, the Authenticator and the AssignmentNotifier, all thread-safe.
using NodeServiceBase = v1::NodeService::WithAsyncMethod_WatchAssignments<
    v1::NodeService::WithCallbackMethod_RegisterNode<v1::NodeService::WithCallbackMethod_Heartbeat<
        v1::NodeService::WithCallbackMethod_Report<v1::NodeService::Service>>>>;

// The server must be given the service as an AsyncServiceHost too
// (GrpcServerOptions::async_hosts), or WatchAssignments calls are never taken.
class NodeService final : public NodeServiceBase, public AsyncServiceHost {
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

  // The leadership epoch RegisterNode and Heartbeat responses carry (leader_epoch; 0 without an
  // election). Set before the server starts.
  void set_leader_epoch(int64_t epoch) { leader_epoch_ = epoch; }

  // AsyncServiceHost: WatchAssignments, one thread per queue.
  int completion_queues() const override;
  void StartServing(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues) override;
  void StopServing() override;

 private:
  class WatchCall;
  // Waits for the next WatchAssignments call on `queue` (nothing once stopping).
  void AcceptWatch(grpc::ServerCompletionQueue* queue);
  // The status a new watch is refused with; OK to take it.
  absl::Status AdmitWatch(const grpc::ServerContext& context,
                          const v1::WatchAssignmentsRequest& request);

  // Admits the caller (node role), then runs `call` (absl::StatusOr<Response>()) on `executor`
  // (null: inline) and finishes the call with its result.
  template <typename Response, typename Call>
  grpc::ServerUnaryReactor* Serve(CallExecutor* executor, grpc::CallbackServerContext* context,
                                  Response* response, Call call);

  Cluster* cluster_;
  int64_t leader_epoch_ = 0;
  Authenticator* authenticator_;
  AssignmentNotifier* notifier_;
  CallExecutor* executor_;

  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> watch_queues_;
  std::vector<std::thread> watch_threads_;
  // Set (under accept_mu_) before the queues shut down: no call is requested on a queue after.
  absl::Mutex accept_mu_;
  bool stopping_ ABSL_GUARDED_BY(accept_mu_) = false;
};

}  // namespace tessera::coordinator
