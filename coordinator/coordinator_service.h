// CoordinatorService: tessera.v1.Coordinator over gRPC's callback API. It
// only converts messages and calls JobManager (and Cluster for nodes), so
// the logic is testable without gRPC; WatchJob streams through a reactor that
// replays stored events and follows new ones without holding a thread.
#pragma once

#include "coordinator/cluster.h"
#include "coordinator/job_manager.h"
#include "coordinator/store.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::coordinator {

// Thread safety: gRPC calls the handlers from its threads; they share only
// the manager and the cluster, which are thread-safe.
class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  CoordinatorService(JobManager* jobs, Cluster* cluster) : jobs_(jobs), cluster_(cluster) {}

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
  grpc::ServerWriteReactor<v1::LogChunk>* GetLogs(grpc::CallbackServerContext* context,
                                                  const v1::GetLogsRequest* request) override;
  grpc::ServerUnaryReactor* PlanLayout(grpc::CallbackServerContext* context,
                                       const v1::PlanLayoutRequest* request,
                                       v1::PlanLayoutResponse* response) override;

 private:
  JobManager* jobs_;
  Cluster* cluster_;
};

}  // namespace tessera::coordinator
