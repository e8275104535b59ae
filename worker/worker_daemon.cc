#include "worker/worker_daemon.h"

#include "common/status_macros.h"

namespace tessera::worker {

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Start(const WorkerOptions& options) {
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon());
  if (!options.metrics_listen_address.empty()) {
    ASSIGN_OR_RETURN(daemon->metrics_,
                     MetricsExposer::Start({.listen_address = options.metrics_listen_address,
                                            .component = "worker"}));
  }
  ASSIGN_OR_RETURN(
      daemon->server_,
      GrpcServer::Start({.listen_address = options.listen_address},
                        {{v1::Worker::service_full_name(), &daemon->worker_service_}}));
  return daemon;
}

void WorkerDaemon::Shutdown(absl::Duration grace) { server_->Shutdown(grace); }

}  // namespace tessera::worker
