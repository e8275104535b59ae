#include "coordinator/coordinator_daemon.h"

#include "common/status_macros.h"

namespace tessera::coordinator {

absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> CoordinatorDaemon::Start(
    const CoordinatorOptions& options) {
  std::unique_ptr<CoordinatorDaemon> daemon(new CoordinatorDaemon());
  ASSIGN_OR_RETURN(daemon->store_, Store::Open(options.state_path));
  daemon->jobs_ = std::make_unique<JobManager>(daemon->store_.get());
  daemon->coordinator_service_ =
      std::make_unique<CoordinatorService>(daemon->jobs_.get(), daemon->store_.get());
  ASSIGN_OR_RETURN(daemon->servers_,
                   DaemonServers::Start(
                       {.component = "coordinator",
                        .listen_address = options.listen_address,
                        .metrics_listen_address = options.metrics_listen_address},
                       {{v1::Coordinator::service_full_name(), daemon->coordinator_service_.get()},
                        {v1::NodeService::service_full_name(), &daemon->node_service_}}));
  return daemon;
}

}  // namespace tessera::coordinator
