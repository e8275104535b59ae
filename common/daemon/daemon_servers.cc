#include "common/daemon/daemon_servers.h"

#include <iostream>

#include "common/daemon/shutdown_signal.h"
#include "common/status_macros.h"

namespace tessera {

absl::StatusOr<std::unique_ptr<DaemonServers>> DaemonServers::Start(
    const DaemonServerOptions& options, const std::vector<NamedService>& services,
    const InterceptorMaker& make_interceptors) {
  std::unique_ptr<DaemonServers> servers(new DaemonServers());
  if (!options.metrics_listen_address.empty()) {
    ASSIGN_OR_RETURN(servers->metrics_,
                     MetricsExposer::Start({.listen_address = options.metrics_listen_address,
                                            .component = options.component}));
    // Every daemon serves its own process's CPU, memory, descriptors and start time.
    servers->process_ = std::make_shared<ProcessMetrics>();
    servers->metrics_->RegisterCollectable(servers->process_);
  }
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  if (make_interceptors) interceptors = make_interceptors(servers->registry());
  ASSIGN_OR_RETURN(servers->grpc_,
                   GrpcServer::Start({.listen_address = options.listen_address,
                                      .max_message_bytes = options.max_message_bytes,
                                      .credentials = options.credentials,
                                      .async_hosts = options.async_hosts},
                                     services, std::move(interceptors)));
  return servers;
}

int ServeUntilSignal(const std::string& binary, DaemonServers& servers,
                     const std::function<void()>& before_shutdown) {
  std::cerr << binary << ": serving gRPC on " << servers.address();
  if (servers.metrics_port() > 0) std::cerr << ", metrics on port " << servers.metrics_port();
  std::cerr << std::endl;
  int signal_number = WaitForShutdownSignal();
  std::cerr << binary << ": signal " << signal_number << ", shutting down" << std::endl;
  if (before_shutdown) before_shutdown();
  servers.Shutdown();
  return 0;
}

}  // namespace tessera
