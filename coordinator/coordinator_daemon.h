// CoordinatorDaemon: the coordinator process's services. It serves the
// client-facing tessera.v1.Coordinator and the worker-facing
// tessera.v1.NodeService on one gRPC port (with health and reflection), and
// Prometheus metrics on another.
//
// The services' handlers arrive with the coordinator issue; until then every
// method answers UNIMPLEMENTED, which is the contract's own default.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/daemon/daemon_servers.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

struct CoordinatorOptions {
  // gRPC listen address (clients and workers).
  std::string listen_address = "127.0.0.1:50051";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9464";
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

  v1::Coordinator::CallbackService coordinator_service_;
  v1::NodeService::CallbackService node_service_;
  // Declared last: stopped (destroyed) before the services it serves.
  std::unique_ptr<DaemonServers> servers_;
};

}  // namespace tessera::coordinator
