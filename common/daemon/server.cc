#include "common/daemon/server.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "grpc/grpc.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace tessera {
namespace {

// The host part of host:port ("[::1]:5" -> "[::1]"), for address().
std::string HostOf(absl::string_view address) {
  size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return std::string(address);
  return std::string(address.substr(0, colon));
}

// One per call, made when the call starts and destroyed when it ends: the server's calls in
// flight, for Shutdown.
class CallCounter final : public grpc::experimental::Interceptor {
 public:
  explicit CallCounter(std::atomic<int64_t>* calls) : calls_(calls) {
    calls_->fetch_add(1, std::memory_order_relaxed);
  }
  ~CallCounter() override { calls_->fetch_sub(1, std::memory_order_relaxed); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  std::atomic<int64_t>* const calls_;
};

class CallCounterFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallCounterFactory(std::shared_ptr<std::atomic<int64_t>> calls)
      : calls_(std::move(calls)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo*) override {
    return new CallCounter(calls_.get());
  }

 private:
  const std::shared_ptr<std::atomic<int64_t>> calls_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(
    const GrpcServerOptions& options, const std::vector<NamedService>& services,
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors) {
  // Both are process-wide switches read when a builder is created.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      options.listen_address,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &port);
  // gRPC sets SO_REUSEPORT by default, which lets a second daemon bind the
  // same port and silently take half the connections. One owner per port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  for (const NamedService& named : services) builder.RegisterService(named.service);
  auto calls = std::make_shared<std::atomic<int64_t>>(0);
  interceptors.push_back(std::make_unique<CallCounterFactory>(calls));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::vector<std::vector<std::unique_ptr<grpc::ServerCompletionQueue>>> queues;
  for (AsyncServiceHost* host : options.async_hosts) {
    auto& own = queues.emplace_back();
    for (int i = 0; i < std::max(1, host->completion_queues()); ++i) {
      own.push_back(builder.AddCompletionQueue());
    }
  }

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    // The queues were never served; a built server is shut down before they are.
    if (server != nullptr) server->Shutdown(std::chrono::system_clock::now());
    for (auto& own : queues) {
      for (auto& queue : own) {
        queue->Shutdown();
        void* tag;
        bool ok;
        while (queue->Next(&tag, &ok)) {
        }
      }
    }
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_address,
                                               " (address in use, or not a valid host:port)"));
  }
  for (size_t i = 0; i < options.async_hosts.size(); ++i) {
    options.async_hosts[i]->StartServing(std::move(queues[i]));
  }
  if (auto* health = server->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(true);
    for (const NamedService& named : services) {
      health->SetServingStatus(named.name, named.serving_at_start);
    }
  }
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(server), std::move(calls),
                                                    HostOf(options.listen_address), port,
                                                    options.async_hosts));
}

GrpcServer::GrpcServer(std::unique_ptr<grpc::Server> server,
                       std::shared_ptr<const std::atomic<int64_t>> calls, std::string host,
                       int port, std::vector<AsyncServiceHost*> async_hosts)
    : server_(std::move(server)),
      calls_(std::move(calls)),
      async_hosts_(std::move(async_hosts)),
      host_(std::move(host)),
      port_(port) {}

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

std::string GrpcServer::address() const { return absl::StrCat(host_, ":", port_); }

std::shared_ptr<grpc::Channel> GrpcServer::InProcessChannel() const {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void GrpcServer::SetServing(const std::string& name, bool serving) {
  if (shut_down_.load()) return;
  if (auto* health = server_->GetHealthCheckService(); health != nullptr) {
    health->SetServingStatus(name, serving);
  }
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (shut_down_.exchange(true)) return;
  if (auto* health = server_->GetHealthCheckService(); health != nullptr) {
    health->Shutdown();
  }
  // gRPC's shutdown lets the calls in flight finish, and also waits for every client connection
  // to answer a ping after its GOAWAY. A client that polls its connection only while it has a
  // call of its own (gRPC's synchronous API) answers only when it next makes a call, or at its
  // backup poll (5 s), so one idle client held the whole grace. Once no call has been in flight
  // for kQuietBeforeClosing (room for calls the clients sent before the GOAWAY reached them),
  // what is left is idle connections: they are closed.
  absl::Notification shut;
  std::thread closer([this, &shut] {
    absl::Time quiet_since = absl::InfiniteFuture();
    while (!shut.WaitForNotificationWithTimeout(absl::Milliseconds(10))) {
      if (calls_->load(std::memory_order_relaxed) > 0) {
        quiet_since = absl::InfiniteFuture();
      } else if (quiet_since == absl::InfiniteFuture()) {
        quiet_since = absl::Now();
      } else if (absl::Now() - quiet_since >= kQuietBeforeClosing) {
        grpc_server_cancel_all_calls(server_->c_server());
        return;
      }
    }
  });
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  shut.Notify();
  closer.join();
  server_->Wait();
  // Only now: a completion queue must outlive the server's use of it.
  for (AsyncServiceHost* host : async_hosts_) host->StopServing();
}

std::shared_ptr<grpc::Channel> MakeClientChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials,
    const std::string& tls_server_name) {
  if (credentials == nullptr) {
    return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  }
  if (tls_server_name.empty()) return grpc::CreateChannel(address, credentials);
  grpc::ChannelArguments arguments;
  arguments.SetSslTargetNameOverride(tls_server_name);
  return grpc::CreateCustomChannel(address, credentials, arguments);
}

}  // namespace tessera
