// StandbyServer (standby_server.h): a gRPC server with health, reflection and one generic
// handler that refuses the coordinator's services, and a /metrics listener. Thread safety as the
// header says.
#include "coordinator/ha/standby_server.h"

#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::coordinator {
namespace {

// "127.0.0.1" of "127.0.0.1:50051", "[::1]" of "[::1]:0".
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

LeadershipGauges::LeadershipGauges(prometheus::Registry& registry)
    : leader_(prometheus::BuildGauge()
                  .Name("tessera_coordinator_leader")
                  .Help("1 when this coordinator leads, 0 when it is a standby.")
                  .Register(registry)
                  .Add({})),
      epoch_(prometheus::BuildGauge()
                 .Name("tessera_coordinator_leader_epoch")
                 .Help("The leadership epoch this coordinator leads with; a standby's: the "
                       "current leader's, as it last read it (0: none elected yet).")
                 .Register(registry)
                 .Add({})) {}

void LeadershipGauges::Set(bool leading, int64_t epoch) {
  leader_.Set(leading ? 1 : 0);
  epoch_.Set(static_cast<double>(epoch));
}

// Answers every call at once, without reading its request: the method name is all it needs.
class StandbyServer::Handler final : public grpc::CallbackGenericService {
 public:
  explicit Handler(StandbyServer* server) : server_(server) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* context) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      Refusal(grpc::GenericCallbackServerContext* context, const grpc::Status& status,
              const std::string& leader) {
        if (!leader.empty()) context->AddTrailingMetadata(kLeaderMetadataKey, leader);
        Finish(status);
      }
      void OnDone() override { delete this; }
    };
    grpc::Status status;
    std::string leader;
    server_->Answer(context->method(), &status, &leader);
    return new Refusal(context, status, leader);
  }

 private:
  StandbyServer* const server_;
};

absl::StatusOr<std::unique_ptr<StandbyServer>> StandbyServer::Start(
    const StandbyServerOptions& options) {
  std::unique_ptr<StandbyServer> server(new StandbyServer());
  if (!options.metrics_listen_address.empty()) {
    ASSIGN_OR_RETURN(server->metrics_,
                     MetricsExposer::Start({.listen_address = options.metrics_listen_address,
                                            .component = "coordinator"}));
    server->gauges_ = std::make_unique<LeadershipGauges>(server->metrics_->registry());
    server->gauges_->Set(false, 0);
  }
  if (!options.health_listen_address.empty()) {
    ASSIGN_OR_RETURN(server->health_,
                     DaemonServers::StartHealthListener(
                         options.health_listen_address,
                         {{.name = v1::Coordinator::service_full_name(),
                           .service = nullptr,
                           .serving_at_start = false},
                          {.name = v1::NodeService::service_full_name(),
                           .service = nullptr,
                           .serving_at_start = false}}));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  server->handler_ = std::make_unique<Handler>(server.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      options.listen_address,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  // One owner per port (as GrpcServer): the leader's server binds it after this one is gone.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterCallbackGenericService(server->handler_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               " (address in use, or not a valid host:port)"));
  }
  if (auto* health = server->server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(true);
    health->SetServingStatus(v1::Coordinator::service_full_name(), false);
    health->SetServingStatus(v1::NodeService::service_full_name(), false);
  }
  server->host_ = HostOf(options.listen_address);
  server->advertise_ =
      options.advertise_address.empty() ? server->address() : options.advertise_address;
  return server;
}

StandbyServer::~StandbyServer() { Shutdown(); }

std::string StandbyServer::address() const { return absl::StrCat(host_, ":", port_); }

void StandbyServer::SetLeader(int64_t epoch, const std::string& address) {
  {
    absl::MutexLock lock(&mu_);
    leader_ = address;
  }
  if (gauges_) gauges_->Set(false, epoch);
}

void StandbyServer::Answer(const std::string& method, grpc::Status* status, std::string* leader) {
  const bool ours =
      absl::StartsWith(method, absl::StrCat("/", v1::Coordinator::service_full_name(), "/")) ||
      absl::StartsWith(method, absl::StrCat("/", v1::NodeService::service_full_name(), "/"));
  if (!ours) {
    *status = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                           absl::StrCat("coordinator ", advertise_, " serves no ", method));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    *leader = leader_;
  }
  *status = grpc::Status(
      grpc::StatusCode::UNAVAILABLE,
      leader->empty()
          ? absl::StrCat("coordinator ", advertise_, " is a standby; no leader is elected yet")
          : absl::StrCat("coordinator ", advertise_, " is a standby; the leader is at ", *leader));
}

void StandbyServer::Shutdown() {
  if (server_ != nullptr) {
    // Every call is answered at once: nothing to wait for.
    server_->Shutdown(std::chrono::system_clock::now());
    server_->Wait();
    server_.reset();
  }
  health_.reset();
  gauges_.reset();
  metrics_.reset();
}

}  // namespace tessera::coordinator
