// WorkerDaemon: the per-node daemon's services. It serves tessera.v1.Worker
// (log relay, node status) with health and reflection, and Prometheus
// metrics. Registration, heartbeats and trainer supervision arrive with the
// worker issue; until then Worker methods answer UNIMPLEMENTED.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/daemon/daemon_servers.h"
#include "tessera/v1/worker_service.grpc.pb.h"

namespace tessera::worker {

struct WorkerOptions {
  // gRPC listen address of the worker's own service.
  std::string listen_address = "127.0.0.1:50052";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9465";
};

// Thread safety: Start and servers().Shutdown from one thread.
class WorkerDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Start(const WorkerOptions& options);

  DaemonServers& servers() { return *servers_; }

 private:
  WorkerDaemon() = default;

  v1::Worker::CallbackService worker_service_;
  // Declared last: stopped (destroyed) before the service it serves.
  std::unique_ptr<DaemonServers> servers_;
};

}  // namespace tessera::worker
