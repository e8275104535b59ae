// LogRelay: Coordinator.GetLogs. Trainer logs stay on the nodes that wrote
// them; the relay opens Worker.ReadLogs on every node of the job (or the one
// holding the requested rank), in parallel, and merges the chunks into the
// client's stream as they arrive. It ends when every node's stream has ended
// (immediately unless `follow`), and fails only when every node failed.
#pragma once

#include <memory>
#include <string>

#include "coordinator/cluster/cluster.h"
#include "coordinator/jobs/job_manager.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/server_callback.h"
#include "tessera/v1/coordinator_service.pb.h"

namespace tessera::coordinator {

// How the coordinator calls workers' log service.
struct WorkerChannelSecurity {
  // Null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Name the workers' certificates carry; empty: the host of their address.
  std::string tls_server_name;
};

// Starts a relay for `request`; gRPC owns the returned reactor. `stream_slot`
// is held until the stream ends.
grpc::ServerWriteReactor<v1::LogChunk>* StartLogRelay(
    JobManager* jobs, Cluster* cluster, const v1::GetLogsRequest& request,
    const WorkerChannelSecurity& worker_security = {}, std::shared_ptr<void> stream_slot = nullptr);

}  // namespace tessera::coordinator
