// CoordinatorService: tessera.v1.Coordinator over gRPC's callback API. It
// only converts messages and calls JobManager (and Cluster for nodes), so
// the logic is testable without gRPC; WatchJob streams through a reactor that
// replays stored events and follows new ones without holding a thread.
#pragma once

#include <memory>

#include "common/daemon/call_executor.h"
#include "coordinator/auth/auth.h"
#include "coordinator/auth/client_limits.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/service/log_relay.h"
#include "coordinator/store/store.h"
#include "grpcpp/security/credentials.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::coordinator {

// Every call is authenticated and authorized first (see auth.h): an
// unauthenticated call gets UNAUTHENTICATED and a call its roles do not allow
// PERMISSION_DENIED, before any data is read.
//
// Thread safety: gRPC calls the handlers from its threads, and unary calls do
// their work on the executor's; they share only the manager, the cluster, the
// authenticator and the limits, which are thread-safe.
class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // `authenticator` and `limits` may be null: open, unlimited (in-process tests).
  // `worker_security` secures the calls to workers' log service. Unary calls run on `executor`
  // (they read and write the store, whose commits wait on the disk); null: on gRPC's threads.
  CoordinatorService(JobManager* jobs, Cluster* cluster, Authenticator* authenticator = nullptr,
                     ClientLimits* limits = nullptr, WorkerChannelSecurity worker_security = {},
                     CallExecutor* executor = nullptr)
      : jobs_(jobs),
        cluster_(cluster),
        authenticator_(authenticator),
        limits_(limits),
        worker_security_(std::move(worker_security)),
        executor_(executor) {}

  grpc::ServerUnaryReactor* SubmitJob(grpc::CallbackServerContext* context,
                                      const v1::SubmitJobRequest* request,
                                      v1::SubmitJobResponse* response) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* context,
                                   const v1::GetJobRequest* request,
                                   v1::GetJobResponse* response) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* context,
                                     const v1::ListJobsRequest* request,
                                     v1::ListJobsResponse* response) override;
  grpc::ServerUnaryReactor* CancelJob(grpc::CallbackServerContext* context,
                                      const v1::CancelJobRequest* request,
                                      v1::CancelJobResponse* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* context,
                                                   const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* GetMetrics(grpc::CallbackServerContext* context,
                                       const v1::GetMetricsRequest* request,
                                       v1::GetMetricsResponse* response) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* context,
                                            const v1::ListCheckpointsRequest* request,
                                            v1::ListCheckpointsResponse* response) override;
  grpc::ServerUnaryReactor* ListNodes(grpc::CallbackServerContext* context,
                                      const v1::ListNodesRequest* request,
                                      v1::ListNodesResponse* response) override;
  grpc::ServerUnaryReactor* ListQueues(grpc::CallbackServerContext* context,
                                       const v1::ListQueuesRequest* request,
                                       v1::ListQueuesResponse* response) override;
  grpc::ServerUnaryReactor* DrainNode(grpc::CallbackServerContext* context,
                                      const v1::DrainNodeRequest* request,
                                      v1::DrainNodeResponse* response) override;
  grpc::ServerUnaryReactor* UndrainNode(grpc::CallbackServerContext* context,
                                        const v1::UndrainNodeRequest* request,
                                        v1::UndrainNodeResponse* response) override;
  grpc::ServerUnaryReactor* RemoveNode(grpc::CallbackServerContext* context,
                                       const v1::RemoveNodeRequest* request,
                                       v1::RemoveNodeResponse* response) override;
  grpc::ServerWriteReactor<v1::LogChunk>* GetLogs(grpc::CallbackServerContext* context,
                                                  const v1::GetLogsRequest* request) override;
  grpc::ServerUnaryReactor* PlanLayout(grpc::CallbackServerContext* context,
                                       const v1::PlanLayoutRequest* request,
                                       v1::PlanLayoutResponse* response) override;

 private:
  // Runs `handle` (absl::Status(), filling the response) on executor_ and finishes the call.
  template <typename Handle>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, Handle handle);
  // The caller, allowed to do `action` (for kManageJob, on `job_id`).
  absl::StatusOr<Principal> Admit(grpc::CallbackServerContext* context, Action action,
                                  const std::string& job_id = "");
  // Admit, then one of the caller's stream slots (ClientLimits), held until the stream ends.
  absl::StatusOr<std::shared_ptr<void>> AdmitStream(grpc::CallbackServerContext* context,
                                                    Action action, const std::string& job_id = "");

  JobManager* jobs_;
  Cluster* cluster_;
  Authenticator* authenticator_;
  ClientLimits* limits_;
  WorkerChannelSecurity worker_security_;
  CallExecutor* executor_;
};

// Authenticates a call with `authenticator` (null: open) and checks `action`.
absl::StatusOr<Principal> AdmitCall(Authenticator* authenticator,
                                    const grpc::ServerContextBase& context, Action action,
                                    absl::string_view job_owner = "");

}  // namespace tessera::coordinator
