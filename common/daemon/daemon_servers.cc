#include "common/daemon/daemon_servers.h"

#include <atomic>
#include <chrono>
#include <iostream>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/daemon/shutdown_signal.h"
#include "common/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace tessera {
namespace {

// Drops the builder's process-wide plugins (server reflection, which GrpcServer registers for
// every builder): the health-only port describes no API.
class WithoutPlugins final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<DaemonServers::HealthListener>>
DaemonServers::StartHealthListener(const std::string& listen_address,
                                   const std::vector<NamedService>& services) {
  grpc::EnableDefaultHealthCheckService(true);
  auto listener = std::make_unique<HealthListener>();
  grpc::ServerBuilder builder;
  // Plaintext on purpose: it is what a kubelet's grpc probe speaks, and health statuses are all
  // it serves.
  builder.AddListeningPort(listen_address, grpc::InsecureServerCredentials(), &listener->port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetOption(std::make_unique<WithoutPlugins>());
  listener->queue = builder.AddCompletionQueue();
  listener->server = builder.BuildAndStart();
  listener->poller = std::thread([queue = listener->queue.get()] {
    void* tag;
    bool ok;
    while (queue->Next(&tag, &ok)) {
    }
  });
  if (listener->server == nullptr || listener->port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address,
                                               " (--health_listen: address in use, or not a "
                                               "valid host:port)"));
  }
  grpc::HealthCheckServiceInterface* health = listener->server->GetHealthCheckService();
  if (health == nullptr) {
    return absl::InternalError("the health-only gRPC server has no health service");
  }
  health->SetServingStatus(true);
  for (const NamedService& named : services) {
    health->SetServingStatus(named.name, named.serving_at_start);
  }
  return listener;
}

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
  if (!options.health_listen_address.empty()) {
    ASSIGN_OR_RETURN(servers->health_,
                     StartHealthListener(options.health_listen_address, services));
  }
  return servers;
}

DaemonServers::~DaemonServers() = default;

int DaemonServers::health_port() const { return health_ ? health_->port : 0; }

void DaemonServers::SetServing(const std::string& name, bool serving) {
  grpc_->SetServing(name, serving);
  if (health_ != nullptr && !health_->shut_down.load()) {
    health_->server->GetHealthCheckService()->SetServingStatus(name, serving);
  }
}

void DaemonServers::Shutdown(absl::Duration grace) {
  if (health_ != nullptr && !health_->shut_down.exchange(true)) {
    // Every service NOT_SERVING, still answered while the main port drains.
    health_->server->GetHealthCheckService()->Shutdown();
  }
  grpc_->Shutdown(grace);
  if (health_ != nullptr) health_->Stop();
}

int ServeUntilSignal(const std::string& binary, DaemonServers& servers,
                     const std::function<void()>& before_shutdown) {
  std::cerr << binary << ": serving gRPC on " << servers.address();
  if (servers.metrics_port() > 0) std::cerr << ", metrics on port " << servers.metrics_port();
  if (servers.health_port() > 0) std::cerr << ", health on port " << servers.health_port();
  std::cerr << std::endl;
  int signal_number = WaitForShutdownSignal();
  std::cerr << binary << ": signal " << signal_number << ", shutting down" << std::endl;
  if (before_shutdown) before_shutdown();
  servers.Shutdown();
  return 0;
}

}  // namespace tessera
