// DaemonServers: the listeners every Tessera daemon runs (gRPC with health and
// reflection, Prometheus /metrics, and optionally a plaintext port that serves
// only the health service), started and stopped together, and
// ServeUntilSignal, the body of a daemon's main().
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/daemon/metrics_exposer.h"
#include "common/daemon/process_metrics.h"
#include "common/daemon/server.h"
#include "grpcpp/server.h"

namespace tessera {

struct DaemonServerOptions {
  // Label of tessera_build_info and prefix of log lines ("coordinator").
  std::string component;
  // gRPC listen address (host:port); port 0 picks one.
  std::string listen_address;
  // Prometheus listen address (host:port); empty disables the endpoint.
  std::string metrics_listen_address;
  // A plaintext gRPC port serving grpc.health.v1 and nothing else, with the
  // statuses of the main port (host:port; empty: none). Kubernetes' grpc probe
  // cannot speak TLS, so with TLS on the main port a probe asks this one.
  std::string health_listen_address;
  // gRPC transport security; null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Largest gRPC message accepted or sent, in bytes.
  int max_message_bytes = 64 << 20;
  // Services with asynchronous methods (GrpcServerOptions::async_hosts).
  std::vector<AsyncServiceHost*> async_hosts{};
};

// Makes the gRPC interceptors of a daemon once its metrics registry exists
// (null when metrics are disabled).
using InterceptorMaker = std::function<
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>(
        prometheus::Registry* registry)>;

// Thread safety: Start and Shutdown from one thread; registry() and SetServing
// from any.
class DaemonServers {
 public:
  // Starts metrics first, so the daemon is observable from its first call.
  static absl::StatusOr<std::unique_ptr<DaemonServers>> Start(
      const DaemonServerOptions& options, const std::vector<NamedService>& services,
      const InterceptorMaker& make_interceptors = nullptr);

  // gRPC address with the bound port.
  std::string address() const { return grpc_->address(); }
  // Bound health-only port; 0 when disabled.
  int health_port() const;
  // Bound metrics port; 0 when disabled.
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // Where the daemon registers its metrics; null when metrics are disabled.
  prometheus::Registry* registry() { return metrics_ ? &metrics_->registry() : nullptr; }
  // Serves `collectable`'s samples on /metrics too, while it lives (no-op when metrics are off).
  void RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& collectable) {
    if (metrics_) metrics_->RegisterCollectable(collectable);
  }

  // GrpcServer::SetServing, on the main port and the health-only port alike.
  void SetServing(const std::string& name, bool serving);

  // Reports NOT_SERVING on the health-only port first (a readiness probe then
  // takes the pod out of its Services while the main port drains), then shuts
  // both down.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  ~DaemonServers();

  // A health-only listener: its own plaintext grpc::Server with the default health service, no
  // reflection and no other service; "" SERVING and each of `services` as it says at start.
  // Also what a standby coordinator (coordinator/ha/standby_server.h) serves for its probes.
  struct HealthListener;
  static absl::StatusOr<std::unique_ptr<HealthListener>> StartHealthListener(
      const std::string& listen_address, const std::vector<NamedService>& services);

 private:
  DaemonServers() = default;

  std::unique_ptr<MetricsExposer> metrics_;
  std::shared_ptr<ProcessMetrics> process_;
  std::unique_ptr<GrpcServer> grpc_;
  std::unique_ptr<HealthListener> health_;
};

struct DaemonServers::HealthListener {
  ~HealthListener() { Stop(); }

  // Idempotent; the server first, then the queue it may still post to.
  void Stop() {
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now());
      server->Wait();
    }
    if (queue != nullptr && poller.joinable()) {
      queue->Shutdown();
      poller.join();
    }
  }

  std::unique_ptr<grpc::Server> server;
  // gRPC builds no server without a polled completion queue unless a registered service has
  // callback methods, and the default health service is added only after that check. Nothing
  // is ever queued on it.
  std::unique_ptr<grpc::ServerCompletionQueue> queue;
  std::thread poller;
  int port = 0;
  // Set once the health service has reported NOT_SERVING for good; later SetServing calls are
  // no-ops, as on GrpcServer.
  std::atomic<bool> shut_down{false};
};

// Logs "<binary>: serving gRPC on HOST:PORT[, metrics on port N][, health on
// port N]" to stderr
// (tests and scripts read the bound ports from it), waits for SIGINT or
// SIGTERM, shuts the servers down and returns main()'s exit code. Call
// BlockShutdownSignals() first thing in main().
// `before_shutdown` (may be null) runs first after the signal: ending the
// daemon's long-lived streams, so that a daemon with no call in flight stops at
// once rather than after the grace period.
int ServeUntilSignal(const std::string& binary, DaemonServers& servers,
                     const std::function<void()>& before_shutdown = nullptr);

}  // namespace tessera
