// StandbyServer: what a coordinator that does not lead serves on its gRPC and metrics ports
// (the HA contract, docs/coordinator.md "High availability"). The health service reports the
// process ("") SERVING and tessera.v1.Coordinator (readiness) NOT_SERVING; every
// tessera.v1.Coordinator and tessera.v1.NodeService call fails UNAVAILABLE "coordinator
// <advertise> is a standby; the leader is at <address>" (or "...; no leader is elected yet") with
// the trailing metadata `tessera-leader` naming the leader, so that clients and workers go there
// at once. /metrics serves tessera_coordinator_leader 0 and the leader's epoch.
//
// One generic handler answers every method that is not health or reflection: a standby knows no
// request type, and new methods of the two services need nothing here.
//
// LeadershipGauges are the two gauges, on a leader's registry as on a standby's.
//
// Thread safety: SetLeader from any thread; handlers read the leader under mu_. Start and
// Shutdown from one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/daemon/daemon_servers.h"
#include "common/daemon/leader_channel.h"  // kLeaderMetadataKey
#include "common/daemon/metrics_exposer.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace tessera::coordinator {

// tessera_coordinator_leader (1 leading, 0 standby) and tessera_coordinator_leader_epoch (the
// epoch this coordinator leads with, or the current leader's as a standby last saw it).
class LeadershipGauges {
 public:
  explicit LeadershipGauges(prometheus::Registry& registry);
  void Set(bool leading, int64_t epoch);

 private:
  prometheus::Gauge& leader_;
  prometheus::Gauge& epoch_;
};

struct StandbyServerOptions {
  // gRPC and Prometheus listen addresses (host:port; port 0 picks one; empty metrics: none).
  std::string listen_address;
  std::string metrics_listen_address;
  // This coordinator's address as the others name it; empty: the bound listen address.
  std::string advertise_address;
  // Transport security of the gRPC port; null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // The plaintext health-only port for kubelets' probes (--health_listen); empty: none. It says
  // what the main port's health service says: alive, not ready.
  std::string health_listen_address;
};

class StandbyServer {
 public:
  // UNAVAILABLE when a port cannot be bound.
  static absl::StatusOr<std::unique_ptr<StandbyServer>> Start(const StandbyServerOptions& options);
  ~StandbyServer();
  StandbyServer(const StandbyServer&) = delete;
  StandbyServer& operator=(const StandbyServer&) = delete;

  // The bound gRPC address (host:port) and metrics port (0: none).
  std::string address() const;
  int port() const { return port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // The health-only port bound (0: none), for the leader to take over after the standby.
  int health_port() const { return health_ ? health_->port : 0; }
  // advertise_address, or address() when it was empty.
  const std::string& advertise_address() const { return advertise_; }

  // The leader as the lease names it; an empty address: none elected (or its lease expired).
  void SetLeader(int64_t epoch, const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

  // Stops both listeners and frees their ports (the leader's servers bind them next).
  // Idempotent.
  void Shutdown();

 private:
  class Handler;
  StandbyServer() = default;
  // The status and leader address of a call to `method`.
  void Answer(const std::string& method, grpc::Status* status, std::string* leader)
      ABSL_LOCKS_EXCLUDED(mu_);

  std::unique_ptr<Handler> handler_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsExposer> metrics_;
  std::unique_ptr<DaemonServers::HealthListener> health_;
  std::unique_ptr<LeadershipGauges> gauges_;
  std::string host_;
  int port_ = 0;
  std::string advertise_;
  absl::Mutex mu_;
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator
