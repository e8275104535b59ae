// WorkerDaemon: the per-node daemon. It serves tessera.v1.Worker (logs, node
// view) with health and reflection and Prometheus metrics, and runs the
// WorkerAgent that registers with the coordinator and runs trainers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/daemon/daemon_servers.h"
#include "common/security/daemon_security.h"
#include "worker/contact_metrics.h"
#include "worker/gpu_inventory.h"
#include "worker/shard_cache.h"
#include "worker/training_metrics.h"
#include "worker/worker_agent.h"
#include "worker/worker_service.h"

namespace tessera::worker {

struct WorkerOptions {
  // gRPC listen address of the worker's own service.
  std::string listen_address = "127.0.0.1:50052";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9465";
  // Plaintext port serving only the health service (DaemonServerOptions); empty: none.
  std::string health_listen_address;
  // Host the coordinator uses to reach this worker; empty means the listen
  // host (or the hostname when listening on all interfaces).
  std::string advertise_host;
  // Registration, trainers and relay.
  WorkerAgentOptions agent;
  // TLS of the worker's own port (which then requires a client certificate
  // signed by the CA: only the coordinator calls it) and of its calls to the
  // coordinator.
  DaemonSecurityOptions security;
  // Certificate CNs allowed to call the worker's service (the coordinator's); empty: any
  // certificate the CA signed.
  std::vector<std::string> allowed_callers;
  // Most checkpoint shard bytes kept in memory for recovery (worker/shard_cache.h); -1: a quarter
  // of the node's memory (DefaultShardCacheBytes); 0: no cache (trainers resume from storage).
  int64_t shard_cache_bytes = -1;
  // Certificate CNs allowed to call the ShardCache service (the peer workers'); empty: this
  // worker's own certificate CN (workers that share one), under TLS; {"*"}: any certificate the
  // CA signed. Unused without TLS.
  std::vector<std::string> shard_cache_allowed_callers;
};

// Thread safety: Start and destruction from one thread.
class WorkerDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Start(const WorkerOptions& options);
  // Stops the agent (and its trainers) before the servers.
  ~WorkerDaemon();

  DaemonServers& servers() { return *servers_; }

 private:
  WorkerDaemon() = default;
  // Creates the shard cache (unless options.shard_cache_bytes is 0) and its local socket in the
  // agent's work directory, whose path it sets in `agent`.
  absl::Status StartShardCache(const WorkerOptions& options, WorkerAgentOptions& agent);

  // Checkpoint shards in memory (null without a cache). Declared first: the local socket, the
  // gRPC service and the agent's report observer use them until they are gone.
  std::unique_ptr<ShardCacheStore> shard_store_;
  std::unique_ptr<ShardCachePeers> shard_peers_;
  std::unique_ptr<ShardCacheMetrics> shard_metrics_;
  std::unique_ptr<LocalShardCacheServer> shard_socket_;
  std::unique_ptr<ShardCacheService> shard_service_;
  // Null when metrics are disabled. Declared before the agent, which reports
  // into them, so they outlive it.
  std::unique_ptr<DcgmExporter> dcgm_;
  std::shared_ptr<TrainingMetrics> training_;
  std::shared_ptr<CoordinatorContactMetrics> contact_;
  std::unique_ptr<WorkerAgent> agent_;
  std::unique_ptr<WorkerService> worker_service_;
  // Declared last: stopped (destroyed) before the service it serves.
  std::unique_ptr<DaemonServers> servers_;
};

}  // namespace tessera::worker
