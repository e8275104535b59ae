// tessera-worker: the per-node daemon that runs trainer processes.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "common/command_line.h"
#include "common/daemon/daemon_servers.h"
#include "common/daemon/shutdown_signal.h"
#include "common/version.h"
#include "worker/worker_daemon.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50052",
          "gRPC listen address (host:port) of the worker's own service; port 0 picks one.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9465",
          "Prometheus /metrics listen address (host:port); empty disables it.");

constexpr char kUsage[] =
    "Usage: tessera-worker [--listen=HOST:PORT] [--metrics_listen=HOST:PORT]\n\n"
    "The Tessera worker: one per node; launches and supervises trainer processes\n"
    "for the coordinator.\n";

int main(int argc, char** argv) {
  tessera::BlockShutdownSignals();
  tessera::ParseCommandLine(argc, argv, kUsage);

  tessera::worker::WorkerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen_address = absl::GetFlag(FLAGS_metrics_listen);
  auto daemon = tessera::worker::WorkerDaemon::Start(options);
  if (!daemon.ok()) {
    std::cerr << "tessera-worker: " << daemon.status() << "\n";
    return 1;
  }
  return tessera::ServeUntilSignal("tessera-worker", (*daemon)->servers());
}
