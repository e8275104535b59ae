// tessera-coordinator: the control-plane daemon.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "common/daemon/daemon_main.h"
#include "common/daemon/daemon_servers.h"
#include "common/version.h"
#include "coordinator/scheduler/topology.h"
#include "coordinator/service/coordinator_daemon.h"
#include "coordinator/service/leader_run.h"
#include "coordinator/store/store.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC listen address (host:port) for clients and workers; port 0 picks one.");
ABSL_FLAG(std::string, health_listen, "",
          "Plaintext gRPC port serving only grpc.health.v1 (for probes that cannot speak TLS); "
          "empty: none.");
ABSL_FLAG(std::string, state, "tessera-coordinator.db",
          "Where the coordinator's state lives (jobs, events, metrics, checkpoints, nodes): a "
          "SQLite file, created if missing (put it on a persistent volume), or a "
          "postgresql://USER@HOST:PORT/DBNAME URL (no password in it: see "
          "--database_password_file).");
ABSL_FLAG(std::string, database_password_file, "",
          "File whose first line is the PostgreSQL password of --state; empty: libpq's "
          "PGPASSWORD or PGPASSFILE (~/.pgpass).");
ABSL_FLAG(std::string, advertise_address, "",
          "With a postgresql:// --state: the address (host:port) other coordinators name as "
          "this one's when it leads, which clients and workers dial (on Kubernetes the pod IP); "
          "empty: the bound --listen address.");
ABSL_FLAG(double, leader_lease_seconds, 5,
          "With a postgresql:// --state: the leader lease's time to live; the leader renews it "
          "every fifth of it, and a standby takes over once it was not renewed for this long "
          "(by the database's clock).");
ABSL_FLAG(double, standby_poll_seconds, 1,
          "With a postgresql:// --state: how often a standby tries to take the lease.");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(15),
          "A worker silent this long is LOST and its jobs fail, e.g. 15s.");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(2),
          "Heartbeat period asked of workers; also how fast task ends and failures reach the "
          "coordinator.");
ABSL_FLAG(absl::Duration, failure_settle, absl::Seconds(5),
          "After a job attempt's first failure, how long to wait for its cause when only "
          "consequences (peers reporting a lost connection) came in, before blaming one.");
ABSL_FLAG(double, straggler_threshold, 1.2,
          "A rank whose busy time per step exceeds the median rank's by this factor is named "
          "as a straggler.");
ABSL_FLAG(std::string, checkpoint_root, "tessera-checkpoints",
          "Checkpoint directory of jobs whose spec names none: <root>/<job_id>; every node must "
          "see it at the same path.");
ABSL_FLAG(int, master_port_base, 29500,
          "First TCPStore port given to a job's rank 0; jobs whose rank 0 shares a node get the "
          "next ones.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics listen address (host:port); empty disables it.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this coordinator: served on --listen and presented to "
          "workers' log service. Re-read when it changes.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle: verifies client certificates (users, nodes) and the workers' "
          "certificates.");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(10),
          "How often the TLS files are checked for rotation (cert-manager).");
ABSL_FLAG(std::string, worker_tls_name, "",
          "Name the workers' certificates carry (a DNS SAN), checked when the coordinator calls "
          "a worker's log service by its address; empty: the host of the worker's address.");
ABSL_FLAG(bool, insecure, false,
          "Serve plaintext gRPC on a non-loopback --listen address (without TLS the coordinator "
          "refuses to, unless asked).");
ABSL_FLAG(std::string, auth_file, "",
          "YAML file of users: name, roles (viewer, user, admin, node), token_sha256 (see "
          "docs/security.md); re-read when it changes. Empty: no authentication, every caller is "
          "an admin.");
ABSL_FLAG(std::string, queue_file, "",
          "YAML file of queues: nominal GPU and CPU-slot quotas, cohorts that lend unused quota, "
          "who submits where, fair share (see docs/coordinator.md); re-read when it changes, a "
          "bad version refused and the previous one kept. Empty: one queue without quotas.");
ABSL_FLAG(std::string, topology_levels, "",
          "The cluster's topology levels, lowest first, each with the per-device bandwidth a "
          "group confined to one of its domains gets in GB/s (optional), e.g. "
          "'nvlink-domain:900,rack:200,block:50,zone'. Workers name their domain at each level "
          "(--topology); `tessera nodes --topology` shows the tree. Empty: no topology.");
ABSL_FLAG(int, max_submits_per_minute, 60,
          "Jobs one user may submit per minute (bursts up to as many); 0: unlimited.");
ABSL_FLAG(int, max_streams_per_client, 16,
          "WatchJob and GetLogs streams one user may hold open; 0: unlimited.");
ABSL_FLAG(int, max_request_bytes, 64 << 20, "Largest gRPC message accepted, in bytes.");
ABSL_FLAG(int, client_call_threads, 0,
          "Threads that do the work of client calls (they wait on the state store's commits, "
          "not on gRPC's own threads); 0: 2 per core, at least 16.");
ABSL_FLAG(int, max_queued_client_calls, 4096,
          "Client calls waiting for a thread beyond which more are refused with "
          "RESOURCE_EXHAUSTED (retry-after-ms 1000) instead of queued in memory; 0: no limit.");
ABSL_FLAG(int, node_call_threads, 0,
          "Threads that do the work of workers' registrations and reports, and the store writes "
          "heartbeats decide; 0: 8 per core, at least 64.");

constexpr char kUsage[] =
    "Usage: tessera-coordinator [--listen=HOST:PORT] [--metrics_listen=HOST:PORT] "
    "[--state=FILE|postgresql://USER@HOST/DB]\n\n"
    "The Tessera coordinator: takes training jobs over gRPC (tessera.v1.Coordinator),\n"
    "plans and gang-schedules them onto workers (tessera.v1.NodeService).\n";

int main(int argc, char** argv) {
  if (int code = tessera::StartDaemonProcess(argc, argv, kUsage, "coordinator"); code != 0) {
    return code;
  }
  // Debian's Abseil checks every lock acquisition for deadlock cycles, which cost 3% of the
  // coordinator's CPU at 10,000 nodes (bench/control_plane_bench); in-process tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  tessera::coordinator::CoordinatorOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen_address = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen_address = absl::GetFlag(FLAGS_health_listen);
  options.state_path = absl::GetFlag(FLAGS_state);
  options.database_password_file = absl::GetFlag(FLAGS_database_password_file);
  options.cluster.heartbeat_timeout = absl::GetFlag(FLAGS_heartbeat_timeout);
  options.cluster.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.cluster.failure_settle = absl::GetFlag(FLAGS_failure_settle);
  options.cluster.straggler_threshold = absl::GetFlag(FLAGS_straggler_threshold);
  options.cluster.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  options.cluster.base_master_port = absl::GetFlag(FLAGS_master_port_base);
  if (auto levels = tessera::coordinator::ParseTopologyLevels(absl::GetFlag(FLAGS_topology_levels));
      levels.ok()) {
    options.cluster.topology_levels = *std::move(levels);
  } else {
    std::cerr << "tessera-coordinator: " << levels.status().message() << "\n";
    return 2;
  }
  options.security.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.security.tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.security.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.security.insecure = absl::GetFlag(FLAGS_insecure);
  options.worker_tls_server_name = absl::GetFlag(FLAGS_worker_tls_name);
  options.auth_file = absl::GetFlag(FLAGS_auth_file);
  options.queue_file = absl::GetFlag(FLAGS_queue_file);
  options.limits.submits_per_minute = absl::GetFlag(FLAGS_max_submits_per_minute);
  options.limits.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  options.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.client_call_threads = absl::GetFlag(FLAGS_client_call_threads);
  options.node_call_threads = absl::GetFlag(FLAGS_node_call_threads);
  options.max_queued_client_calls = absl::GetFlag(FLAGS_max_queued_client_calls);
  if (tessera::coordinator::Store::IsPostgresUrl(options.state_path)) {
    // Several coordinators may share the database: one leads, the others stand by.
    const double lease = absl::GetFlag(FLAGS_leader_lease_seconds);
    const double poll = absl::GetFlag(FLAGS_standby_poll_seconds);
    if (!(lease > 0) || !(poll > 0)) {
      std::cerr << "tessera-coordinator: --leader_lease_seconds and --standby_poll_seconds must "
                   "be more than 0\n";
      return 2;
    }
    return tessera::coordinator::RunElectedCoordinator(
        options, {.advertise_address = absl::GetFlag(FLAGS_advertise_address),
                  .lease = absl::Seconds(lease),
                  .standby_poll = absl::Seconds(poll)});
  }
  auto daemon = tessera::coordinator::CoordinatorDaemon::Start(options);
  if (!daemon.ok()) {
    std::cerr << "tessera-coordinator: " << daemon.status() << "\n";
    return 1;
  }
  return tessera::ServeUntilSignal("tessera-coordinator", (*daemon)->servers(),
                                   [&daemon] { (*daemon)->PrepareShutdown(); });
}
