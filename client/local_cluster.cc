#include "client/local_cluster.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/daemon_process.h"

namespace tessera::client {
namespace {

// How long a daemon may take to print its "serving gRPC on" line.
constexpr absl::Duration kStartTimeout = absl::Seconds(30);
// How long a daemon may take to exit after SIGTERM before SIGKILL.
constexpr absl::Duration kStopTimeout = absl::Seconds(15);

}  // namespace

absl::StatusOr<LocalDaemon> LocalCluster::Spawn(const std::string& name,
                                                std::vector<std::string> argv,
                                                const std::string& log_path) {
  // In their own process group: the daemons stop on SIGTERM from us, not on the terminal's Ctrl-C.
  auto serving = StartDaemon(argv, log_path, kStartTimeout);
  if (!serving.ok()) {
    return absl::Status(serving.status().code(),
                        absl::StrCat(name, ": ", serving.status().message()));
  }
  LocalDaemon daemon;
  daemon.name = name;
  daemon.log_path = log_path;
  daemon.pid = serving->pid;
  daemon.address = serving->address;
  daemon.metrics_port = serving->metrics_port;
  daemons_.push_back(daemon);
  return daemon;
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  std::error_code error;
  std::filesystem::create_directories(options.dir, error);
  if (error) return absl::FailedPreconditionError(absl::StrCat(options.dir, ": ", error.message()));
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  auto coordinator =
      cluster->Spawn("coordinator",
                     {options.bin_dir + "/tessera-coordinator", "--listen=127.0.0.1:0",
                      "--metrics_listen=127.0.0.1:0", "--state=" + options.dir + "/coordinator.db",
                      "--checkpoint_root=" + options.dir + "/checkpoints"},
                     options.dir + "/coordinator.log");
  if (!coordinator.ok()) return coordinator.status();
  for (int i = 0; i < options.workers; ++i) {
    std::string name = absl::StrCat("worker-", i);
    auto worker = cluster->Spawn(
        name,
        {options.bin_dir + "/tessera-worker", "--coordinator=" + coordinator->address,
         "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--node_name=local-" + name,
         absl::StrCat("--cpu_slots=", options.cpu_slots), "--work_dir=" + options.dir + "/" + name},
        options.dir + "/" + name + ".log");
    if (!worker.ok()) return worker.status();
  }
  return cluster;
}

LocalCluster::~LocalCluster() {
  // Workers first, so they stop their trainers while the coordinator still
  // listens.
  for (auto it = daemons_.rbegin(); it != daemons_.rend(); ++it) {
    if (it->pid > 0) StopDaemon(it->pid, kStopTimeout);
  }
}

}  // namespace tessera::client
