// WorkerService: tessera.v1.Worker, served by each worker: trainer logs
// (ReadLogs, with follow) and the node's own view (GetNode).
//
// It uses gRPC's synchronous API, unlike the other services: a following log
// reader waits on the file between reads, and the synchronous server gives
// each such stream a thread from its bounded pool instead of making a reactor
// juggle a timer.
#pragma once

#include <string>
#include <vector>

#include "tessera/v1/worker_service.grpc.pb.h"
#include "worker/worker_agent.h"

namespace tessera::worker {

// Under mutual TLS only callers whose certificate CN is in `allowed_callers`
// (the coordinator's) get through, when that list is non-empty: a user's
// certificate signed by the same CA must not read trainer logs around the
// coordinator's ownership check.
//
// Thread safety: handlers run on gRPC's threads; they share only the agent.
class WorkerService final : public v1::Worker::Service {
 public:
  explicit WorkerService(WorkerAgent* agent, std::vector<std::string> allowed_callers = {})
      : agent_(agent), allowed_callers_(std::move(allowed_callers)) {}

  grpc::Status ReadLogs(grpc::ServerContext* context, const v1::ReadLogsRequest* request,
                        grpc::ServerWriter<v1::LogChunk>* writer) override;
  grpc::Status GetNode(grpc::ServerContext* context, const v1::GetNodeRequest* request,
                       v1::GetNodeResponse* response) override;

 private:
  // OK, or PERMISSION_DENIED for a caller not in allowed_callers_.
  grpc::Status CheckCaller(const grpc::ServerContext& context) const;

  WorkerAgent* agent_;
  std::vector<std::string> allowed_callers_;
};

}  // namespace tessera::worker
