// CoordinatorDaemon: the coordinator process. It opens the durable store,
// serves the client-facing tessera.v1.Coordinator and the worker-facing
// tessera.v1.NodeService on one gRPC port (with health and reflection), and
// Prometheus metrics on another.
//
// NodeService's handlers (registration, heartbeats, scheduling onto workers)
// are not built yet and answer UNIMPLEMENTED, the contract's default.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/daemon/daemon_servers.h"
#include "coordinator/coordinator_service.h"
#include "coordinator/job_manager.h"
#include "coordinator/store.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

struct CoordinatorOptions {
  // gRPC listen address (clients and workers).
  std::string listen_address = "127.0.0.1:50051";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9464";
  // SQLite file holding jobs, events, metrics, checkpoints and nodes.
  std::string state_path = "tessera-coordinator.db";
};

// Thread safety: Start and servers().Shutdown from one thread; the servers
// run their own threads.
class CoordinatorDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> Start(
      const CoordinatorOptions& options);

  DaemonServers& servers() { return *servers_; }

 private:
  CoordinatorDaemon() = default;

  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<CoordinatorService> coordinator_service_;
  v1::NodeService::CallbackService node_service_;
  // Declared last: stopped (destroyed) before the services it serves.
  std::unique_ptr<DaemonServers> servers_;
};

}  // namespace tessera::coordinator
