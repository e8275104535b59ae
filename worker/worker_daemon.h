// WorkerDaemon: the per-node daemon's servers. It serves tessera.v1.Worker
// (log relay, node status) with health and reflection, and Prometheus
// metrics. Registration, heartbeats and trainer supervision arrive with the
// worker issue; until then Worker methods answer UNIMPLEMENTED.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/daemon/metrics_exposer.h"
#include "common/daemon/server.h"
#include "tessera/v1/worker_service.grpc.pb.h"

namespace tessera::worker {

struct WorkerOptions {
  // gRPC listen address of the worker's own service.
  std::string listen_address = "127.0.0.1:50052";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9465";
};

// Thread safety: Start and Shutdown from one thread.
class WorkerDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Start(const WorkerOptions& options);

  std::string address() const { return server_->address(); }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }

  void Shutdown(absl::Duration grace = absl::Seconds(5));

 private:
  WorkerDaemon() = default;

  v1::Worker::CallbackService worker_service_;
  std::unique_ptr<MetricsExposer> metrics_;
  std::unique_ptr<GrpcServer> server_;
};

}  // namespace tessera::worker
