// WorkerService: tessera.v1.Worker, served by each worker: trainer logs (ReadLogs, with follow)
// and the node's own view (GetNode).
//
// It uses gRPC's callback API, as the coordinator's services do. A following log reader holds no
// thread while it waits for its ranks to write more: between passes over the files that found
// nothing new it sets a grpc::Alarm, whose callback reads again.
#pragma once

#include <string>
#include <vector>

#include "tessera/v1/worker_service.grpc.pb.h"
#include "worker/worker_agent.h"

namespace tessera::worker {

// Under mutual TLS only callers whose certificate CN is in `allowed_callers` (the coordinator's)
// get through, when that list is non-empty: a user's certificate signed by the same CA must not
// read trainer logs around the coordinator's ownership check.
//
// Thread safety: handlers and reactors run on gRPC's threads; they share only the agent.
class WorkerService final : public v1::Worker::CallbackService {
 public:
  explicit WorkerService(WorkerAgent* agent, std::vector<std::string> allowed_callers = {})
      : agent_(agent), allowed_callers_(std::move(allowed_callers)) {}

  grpc::ServerWriteReactor<v1::LogChunk>* ReadLogs(grpc::CallbackServerContext* context,
                                                   const v1::ReadLogsRequest* request) override;
  grpc::ServerUnaryReactor* GetNode(grpc::CallbackServerContext* context,
                                    const v1::GetNodeRequest* request,
                                    v1::GetNodeResponse* response) override;

 private:
  // OK, or PERMISSION_DENIED for a caller not in allowed_callers_.
  grpc::Status CheckCaller(const grpc::ServerContextBase& context) const;

  WorkerAgent* agent_;
  std::vector<std::string> allowed_callers_;
};

}  // namespace tessera::worker
