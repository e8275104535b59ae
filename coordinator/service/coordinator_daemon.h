// CoordinatorDaemon: the coordinator process. It opens the durable store,
// serves the client-facing tessera.v1.Coordinator and the worker-facing
// tessera.v1.NodeService on one gRPC port (with health and reflection), and
// Prometheus metrics on another.
//
// On start it reloads nodes and the allocations of running jobs from the
// store, then runs the cluster's loop (liveness, gang scheduling) until
// destroyed.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/daemon/call_executor.h"
#include "common/daemon/daemon_servers.h"
#include "common/daemon/executor_metrics.h"
#include "common/security/daemon_security.h"
#include "coordinator/auth/auth.h"
#include "coordinator/auth/client_limits.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/ha/standby_server.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "coordinator/queues/queue_file.h"
#include "coordinator/service/coordinator_metrics.h"
#include "coordinator/service/coordinator_service.h"
#include "coordinator/service/node_service.h"
#include "coordinator/store/leader_election.h"
#include "coordinator/store/store.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {

struct CoordinatorOptions {
  // gRPC listen address (clients and workers).
  std::string listen_address = "127.0.0.1:50051";
  // Prometheus /metrics listen address; empty disables the endpoint.
  std::string metrics_listen_address = "127.0.0.1:9464";
  // Plaintext port serving only the health service (DaemonServerOptions); empty: none.
  std::string health_listen_address;
  // SQLite file holding jobs, events, metrics, checkpoints and nodes, or a postgresql:// URL of
  // a database holding them (Store::Open).
  std::string state_path = "tessera-coordinator.db";
  // The PostgreSQL password's file (StoreOptions::password_file); empty: libpq's environment.
  std::string database_password_file;
  // Registry, liveness and scheduling settings.
  ClusterOptions cluster;
  // TLS of the gRPC port and of the calls to workers' log service.
  DaemonSecurityOptions security;
  // Name the workers' certificates carry (they are reached by address, e.g. a
  // pod IP); empty: the host of each worker's address.
  std::string worker_tls_server_name;
  // Users, roles and token hashes (auth.h); empty: no authentication.
  std::string auth_file;
  // Queues, quotas and fair share (queue_config.h); empty: one queue, no quotas.
  std::string queue_file;
  // Per-user submit rate and open streams.
  ClientLimitsOptions limits;
  // Largest gRPC message accepted, in bytes.
  int max_request_bytes = 64 << 20;
  // Threads that do the work of client calls and of workers' calls (common/daemon/
  // call_executor.h); 0: 2 per core, at least 16, and 8 per core, at least 64. Two pools, so
  // that clients whose calls wait on the store cannot hold up workers' reports.
  int client_call_threads = 0;
  int node_call_threads = 0;
  // Client calls waiting for a thread beyond which more are refused (RESOURCE_EXHAUSTED, retry
  // in 1 s) instead of queued in memory; workers' calls are never refused this way.
  int max_queued_client_calls = 4096;
  // The election this coordinator won (not owned; it outlives the daemon); null: no election
  // (SQLite), the one coordinator leads with epoch 0. Its fence guards every store write, its
  // epoch goes into workers' responses and the tessera_coordinator_leader_epoch gauge.
  LeaderElection* election = nullptr;
};

// Thread safety: Start and servers().Shutdown from one thread; the servers
// run their own threads.
class CoordinatorDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> Start(
      const CoordinatorOptions& options);

  // Stops the cluster loop first: it reports into the metrics registry that
  // the servers own.
  ~CoordinatorDaemon();

  DaemonServers& servers() { return *servers_; }
  // Before the servers shut down: ends the open WatchJob and WatchAssignments streams
  // (UNAVAILABLE), which would otherwise hold the shutdown for its whole grace period.
  void PrepareShutdown();

 private:
  CoordinatorDaemon() = default;

  // Null when metrics are disabled. Declared first: destroyed last, after
  // everything that reports to it.
  std::unique_ptr<CoordinatorMetrics> metrics_;
  std::unique_ptr<LeadershipGauges> leadership_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
  // Outlives the cluster, which notifies it, and the node service's streams.
  std::unique_ptr<AssignmentNotifier> notifier_;
  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Authenticator> authenticator_;
  std::unique_ptr<QueueFile> queues_;
  std::unique_ptr<ClientLimits> limits_;
  std::unique_ptr<CoordinatorService> coordinator_service_;
  std::unique_ptr<NodeService> node_service_;
  // Where the services' unary calls do their work. Declared after the cluster and the store
  // they use, before the servers: they outlive every call the servers finish.
  std::unique_ptr<CallExecutor> client_calls_;
  std::unique_ptr<CallExecutor> node_calls_;
  // Their load on /metrics (executor_metrics.h); reads them, so declared after them.
  std::shared_ptr<ExecutorMetrics> executor_metrics_;
  // Declared last: stopped (destroyed) before the services it serves.
  std::unique_ptr<DaemonServers> servers_;
};

}  // namespace tessera::coordinator
