// tessera-worker: the per-node daemon that runs trainer processes.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "common/daemon/daemon_main.h"
#include "common/daemon/daemon_servers.h"
#include "common/read_file.h"
#include "common/version.h"
#include "worker/trainer_process.h"
#include "worker/worker_daemon.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051",
          "Coordinator gRPC address (host:port), or several, comma-separated, of coordinators of "
          "which one leads (HA): calls follow the leader, and a standby's answer names it.");
ABSL_FLAG(std::string, node_name, "", "Node identity in the cluster; empty means the hostname.");
ABSL_FLAG(std::string, listen, "127.0.0.1:50052",
          "gRPC listen address (host:port) of the worker's own service (logs); port 0 picks one.");
ABSL_FLAG(std::string, advertise_host, "",
          "Host the coordinator uses to reach this worker; empty: the listen host, or the "
          "hostname when listening on 0.0.0.0.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9465",
          "Prometheus /metrics listen address (host:port); empty disables it.");
ABSL_FLAG(std::string, health_listen, "",
          "Plaintext gRPC port serving only grpc.health.v1 (for probes that cannot speak TLS); "
          "empty: none.");
ABSL_FLAG(std::string, work_dir, "",
          "Directory for the node key, task files, per-rank logs and the trainers' report socket; "
          "empty: $XDG_STATE_HOME/tessera/worker/NODE (~/.local/state/tessera/worker/NODE), "
          "never the current directory. Keep it across restarts: the node key in it is the "
          "node's identity to the coordinator.");
ABSL_FLAG(int, cpu_slots, 0, "Trainer ranks this node runs on CPU (for nodes without GPUs).");
ABSL_FLAG(std::string, trainer, "",
          "Path of tessera-trainer; empty means the tessera-trainer beside this binary.");
ABSL_FLAG(std::vector<std::string>, labels, {}, "Node labels as key=value,key=value.");
ABSL_FLAG(std::vector<std::string>, topology, {},
          "The node's place in the network as level=domain,level=domain (e.g. "
          "rack=r17,block=b3), the levels being the coordinator's --topology_levels; a level "
          "left out makes the node a domain of its own there.");
ABSL_FLAG(absl::Duration, checkpoint_grace, absl::Minutes(10),
          "Time the ranks of a task asked to checkpoint and stop (its node drained with "
          "--checkpoint) get to save the checkpoint and exit before they are stopped.");
ABSL_FLAG(absl::Duration, coordinator_grace, absl::Minutes(5),
          "How long trainers keep running while no coordinator answers as leader (their reports "
          "are kept); past it the worker asks them to save a checkpoint and stop "
          "(--checkpoint_grace), and reports their end when a leader answers again.");
ABSL_FLAG(absl::Duration, stop_grace, absl::Seconds(10),
          "Time between SIGTERM and SIGKILL when stopping trainers.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this worker: served on --listen and presented to the "
          "coordinator (a node certificate). Re-read when it changes.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle: verifies the coordinator, and the client certificate every caller of "
          "this worker must present.");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(10),
          "How often the TLS files are checked for rotation (cert-manager).");
ABSL_FLAG(bool, insecure, false,
          "Serve plaintext gRPC on a non-loopback --listen address (without TLS the worker "
          "refuses to, unless asked).");
ABSL_FLAG(std::vector<std::string>, tls_allowed_callers, {},
          "Certificate CNs allowed to call this worker's service, e.g. tessera-coordinator; "
          "empty: any certificate signed by --tls_ca.");
ABSL_FLAG(std::string, join_token_file, "",
          "File holding the token this worker presents to the coordinator (a user with the "
          "node role); TESSERA_JOIN_TOKEN is used when empty.");

ABSL_FLAG(int, trainer_threads, 0,
          "Intra-op CPU threads of each trainer (OMP_NUM_THREADS, MKL_NUM_THREADS); 0: this "
          "node's cores divided by its slots (CPU slots, or GPUs), at least 1, so that ranks do "
          "not fight over cores.");
ABSL_FLAG(bool, watch_assignments, true,
          "Keep a stream open to the coordinator (NodeService.WatchAssignments) and heartbeat as "
          "soon as it has tasks to start or stop; false: only the periodic heartbeat delivers "
          "them.");

ABSL_FLAG(int64_t, shard_cache_bytes, -1,
          "Most bytes of checkpoint shards this worker keeps in memory, its trainers' and a copy of "
          "a peer node's, so that a restarted attempt resumes from memory instead of storage; -1: "
          "a quarter of the node's memory; 0: none (resume from storage only).");

ABSL_FLAG(std::vector<std::string>, shard_cache_allowed_callers, {},
          "Certificate CNs allowed to call this worker's ShardCache service (the other workers', "
          "which copy and fetch checkpoint shards); empty: this worker's own --tls_cert CN, for "
          "workers that share one; '*': any certificate signed by --tls_ca. Others get "
          "PERMISSION_DENIED. Unused without TLS.");

// Join token of the worker when --join_token_file is not given.
constexpr char kJoinTokenEnv[] = "TESSERA_JOIN_TOKEN";

namespace {

// Base of the default work directory (XDG Base Directory: state that persists across restarts).
constexpr char kStateHomeEnv[] = "XDG_STATE_HOME";
// Home directory, for ~/.local/state when XDG_STATE_HOME is unset.
constexpr char kHomeEnv[] = "HOME";

// The work directory when --work_dir is empty: per node name, so that several workers on one
// machine (tests, the demo) never share a node key, and outside any source tree.
std::filesystem::path DefaultWorkDir(const std::string& node_id) {
  std::filesystem::path state;
  if (const char* xdg = std::getenv(kStateHomeEnv); xdg != nullptr && xdg[0] == '/') {
    state = xdg;
  } else if (const char* home = std::getenv(kHomeEnv); home != nullptr && home[0] != '\0') {
    state = std::filesystem::path(home) / ".local" / "state";
  } else {
    state = std::filesystem::temp_directory_path();
  }
  return state / "tessera" / "worker" / node_id;
}

}  // namespace

constexpr char kUsage[] =
    "Usage: tessera-worker --coordinator=HOST:PORT[,HOST:PORT...] [--node_name=NAME]\n"
    "                      [--cpu_slots=N] [--coordinator_grace=DURATION]\n"
    "                      [--listen=HOST:PORT] [--metrics_listen=HOST:PORT] [--work_dir=DIR]\n\n"
    "The Tessera worker: one per node; registers the node's GPUs (NVML) or CPU slots with the\n"
    "coordinator, launches and supervises trainer processes, and relays their reports.\n";

int main(int argc, char** argv) {
  if (int code = tessera::StartDaemonProcess(argc, argv, kUsage, "worker"); code != 0) {
    return code;
  }
  // Trainers' orphaned descendants become ours to reap, so stopping a
  // trainer's process group always finishes (PID 1 may not reap them).
  if (auto status = tessera::worker::BecomeChildSubreaper(); !status.ok()) {
    std::cerr << "tessera-worker: " << status << " (orphaned trainer children may linger)\n";
  }

  tessera::worker::WorkerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen_address = absl::GetFlag(FLAGS_metrics_listen);
  options.health_listen_address = absl::GetFlag(FLAGS_health_listen);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  auto& agent = options.agent;
  agent.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  agent.node_id = absl::GetFlag(FLAGS_node_name);
  if (agent.node_id.empty()) {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    agent.node_id = name;
  }
  const std::string work_dir = absl::GetFlag(FLAGS_work_dir);
  agent.work_dir = std::filesystem::absolute(work_dir.empty() ? DefaultWorkDir(agent.node_id)
                                                              : std::filesystem::path(work_dir))
                       .string();
  agent.cpu_slots = absl::GetFlag(FLAGS_cpu_slots);
  agent.trainer_path = absl::GetFlag(FLAGS_trainer);
  if (agent.trainer_path.empty()) {
    std::error_code error;
    auto self = std::filesystem::read_symlink("/proc/self/exe", error);
    agent.trainer_path = (self.parent_path() / "tessera-trainer").string();
  }
  for (const auto& label : absl::GetFlag(FLAGS_labels)) {
    std::pair<std::string, std::string> kv = absl::StrSplit(label, absl::MaxSplits('=', 1));
    agent.labels[kv.first] = kv.second;
  }
  for (const auto& item : absl::GetFlag(FLAGS_topology)) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.first.empty() || kv.second.empty() ||
        !agent.topology.emplace(kv.first, kv.second).second) {
      std::cerr << "tessera-worker: --topology: '" << item
                << "' is not level=domain, or names its level twice\n";
      return 2;
    }
  }
  agent.stop_grace = absl::GetFlag(FLAGS_stop_grace);
  agent.checkpoint_grace = absl::GetFlag(FLAGS_checkpoint_grace);
  agent.coordinator_grace = absl::GetFlag(FLAGS_coordinator_grace);
  agent.trainer_threads = absl::GetFlag(FLAGS_trainer_threads);
  agent.watch_assignments = absl::GetFlag(FLAGS_watch_assignments);

  options.security.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.security.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.security.tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.security.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.security.insecure = absl::GetFlag(FLAGS_insecure);
  options.allowed_callers = absl::GetFlag(FLAGS_tls_allowed_callers);
  options.shard_cache_bytes = absl::GetFlag(FLAGS_shard_cache_bytes);
  options.shard_cache_allowed_callers = absl::GetFlag(FLAGS_shard_cache_allowed_callers);
  if (const std::string path = absl::GetFlag(FLAGS_join_token_file); !path.empty()) {
    auto token = tessera::ReadWholeFile(path);
    if (!token.ok()) {
      std::cerr << "tessera-worker: --join_token_file: " << token.status() << "\n";
      return 1;
    }
    agent.join_token = std::string(absl::StripAsciiWhitespace(*token));
  } else if (const char* token = std::getenv(kJoinTokenEnv); token != nullptr) {
    agent.join_token = std::string(absl::StripAsciiWhitespace(token));
  }
  auto daemon = tessera::worker::WorkerDaemon::Start(options);
  if (!daemon.ok()) {
    std::cerr << "tessera-worker: " << daemon.status() << "\n";
    return 1;
  }
  return tessera::ServeUntilSignal("tessera-worker", (*daemon)->servers());
}
