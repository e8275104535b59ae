#include "worker/worker_daemon.h"

#include "common/status_macros.h"

namespace tessera::worker {

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon());
  ASSIGN_OR_RETURN(
      daemon->servers_,
      DaemonServers::Start({.component = "worker",
                            .listen_address = options.listen_address,
                            .metrics_listen_address = options.metrics_listen_address},
                           {{v1::Worker::service_full_name(), &daemon->worker_service_}}));
  return daemon;
}

}  // namespace tessera::worker
