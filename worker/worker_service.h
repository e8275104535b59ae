// WorkerService: tessera.v1.Worker, served by each worker: trainer logs
// (ReadLogs, with follow) and the node's own view (GetNode).
//
// It uses gRPC's synchronous API, unlike the other services: a following log
// reader waits on the file between reads, and the synchronous server gives
// each such stream a thread from its bounded pool instead of making a reactor
// juggle a timer.
#pragma once

#include "tessera/v1/worker_service.grpc.pb.h"
#include "worker/worker_agent.h"

namespace tessera::worker {

// Thread safety: handlers run on gRPC's threads; they share only the agent.
class WorkerService final : public v1::Worker::Service {
 public:
  explicit WorkerService(WorkerAgent* agent) : agent_(agent) {}

  grpc::Status ReadLogs(grpc::ServerContext* context, const v1::ReadLogsRequest* request,
                        grpc::ServerWriter<v1::LogChunk>* writer) override;
  grpc::Status GetNode(grpc::ServerContext* context, const v1::GetNodeRequest* request,
                       v1::GetNodeResponse* response) override;

 private:
  WorkerAgent* agent_;
};

}  // namespace tessera::worker
