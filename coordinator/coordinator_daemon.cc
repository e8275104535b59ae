#include "coordinator/coordinator_daemon.h"

#include "common/status_macros.h"

namespace tessera::coordinator {

absl::StatusOr<std::unique_ptr<CoordinatorDaemon>> CoordinatorDaemon::Start(
    const CoordinatorOptions& options) {
  std::unique_ptr<CoordinatorDaemon> daemon(new CoordinatorDaemon());
  if (!options.metrics_listen_address.empty()) {
    ASSIGN_OR_RETURN(daemon->metrics_,
                     MetricsExposer::Start({.listen_address = options.metrics_listen_address,
                                            .component = "coordinator"}));
  }
  ASSIGN_OR_RETURN(
      daemon->server_,
      GrpcServer::Start({.listen_address = options.listen_address},
                        {{v1::Coordinator::service_full_name(), &daemon->coordinator_service_},
                         {v1::NodeService::service_full_name(), &daemon->node_service_}}));
  return daemon;
}

void CoordinatorDaemon::Shutdown(absl::Duration grace) { server_->Shutdown(grace); }

}  // namespace tessera::coordinator
