// DaemonServers: the two listeners every Tessera daemon runs (gRPC with
// health and reflection, Prometheus /metrics), started and stopped together,
// and ServeUntilSignal, the body of a daemon's main().
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/daemon/metrics_exposer.h"
#include "common/daemon/process_metrics.h"
#include "common/daemon/server.h"

namespace tessera {

struct DaemonServerOptions {
  // Label of tessera_build_info and prefix of log lines ("coordinator").
  std::string component;
  // gRPC listen address (host:port); port 0 picks one.
  std::string listen_address;
  // Prometheus listen address (host:port); empty disables the endpoint.
  std::string metrics_listen_address;
  // gRPC transport security; null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Largest gRPC message accepted or sent, in bytes.
  int max_message_bytes = 64 << 20;
  // Services with asynchronous methods (GrpcServerOptions::async_hosts).
  std::vector<AsyncServiceHost*> async_hosts;
};

// Makes the gRPC interceptors of a daemon once its metrics registry exists
// (null when metrics are disabled).
using InterceptorMaker = std::function<
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>(
        prometheus::Registry* registry)>;

// Thread safety: Start and Shutdown from one thread; registry() from any.
class DaemonServers {
 public:
  // Starts metrics first, so the daemon is observable from its first call.
  static absl::StatusOr<std::unique_ptr<DaemonServers>> Start(
      const DaemonServerOptions& options, const std::vector<NamedService>& services,
      const InterceptorMaker& make_interceptors = nullptr);

  // gRPC address with the bound port.
  std::string address() const { return grpc_->address(); }
  // Bound metrics port; 0 when disabled.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // Where the daemon registers its metrics; null when metrics are disabled.
  prometheus::Registry* registry() { return metrics_ ? &metrics_->registry() : nullptr; }
  // Serves `collectable`'s samples on /metrics too, while it lives (no-op when metrics are off).
  void RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& collectable) {
    if (metrics_) metrics_->RegisterCollectable(collectable);
  }

  // GrpcServer::SetServing.
  void SetServing(const std::string& name, bool serving) { grpc_->SetServing(name, serving); }

  void Shutdown(absl::Duration grace = absl::Seconds(5)) { grpc_->Shutdown(grace); }

 private:
  DaemonServers() = default;

  std::unique_ptr<MetricsExposer> metrics_;
  std::shared_ptr<ProcessMetrics> process_;
  std::unique_ptr<GrpcServer> grpc_;
};

// Logs "<binary>: serving gRPC on HOST:PORT[, metrics on port N]" to stderr
// (tests and scripts read the bound ports from it), waits for SIGINT or
// SIGTERM, shuts the servers down and returns main()'s exit code. Call
// BlockShutdownSignals() first thing in main().
// `before_shutdown` (may be null) runs first after the signal: ending the
// daemon's long-lived streams, so that a daemon with no call in flight stops at
// once rather than after the grace period.
int ServeUntilSignal(const std::string& binary, DaemonServers& servers,
                     const std::function<void()>& before_shutdown = nullptr);

}  // namespace tessera
