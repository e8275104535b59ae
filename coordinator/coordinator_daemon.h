// CoordinatorDaemon: the coordinator process's servers. It serves the
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
#include "absl/time/time.h"
#include "common/daemon/metrics_exposer.h"
#include "common/daemon/server.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

struct CoordinatorOptions {
  // gRPC listen address (clients and workers).
  std::string listen_address = "127.0.0.1:50051";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9464";
};

// Thread safety: Start and Shutdown from one thread; the servers run their
// own threads.
class CoordinatorDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> Start(
      const CoordinatorOptions& options);

  // Address clients use (with the bound port).
  std::string address() const { return server_->address(); }
  // Bound metrics port, 0 when disabled.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  void Shutdown(absl::Duration grace = absl::Seconds(5));

 private:
  CoordinatorDaemon() = default;

  v1::Coordinator::CallbackService coordinator_service_;
  v1::NodeService::CallbackService node_service_;
  std::unique_ptr<MetricsExposer> metrics_;
  std::unique_ptr<GrpcServer> server_;
};

}  // namespace tessera::coordinator
