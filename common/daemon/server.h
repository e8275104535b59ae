// GrpcServer: a started gRPC server with the features every Tessera daemon
// serves: grpc.health.v1 (one status per registered service), server
// reflection, and a bound port that can be 0 ("pick one") for tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/server_interceptor.h"

namespace tessera {

// A service to serve and the name the health service reports it under
// (the generated class's service_full_name(), e.g. "tessera.v1.Coordinator").
struct NamedService {
  std::string name;
  grpc::Service* service;
  // What the health service first reports for `name`; false: NOT_SERVING until SetServing (a
  // worker is not ready before it has registered, although its process is alive).
  bool serving_at_start = true;
};

// A service with methods on gRPC's asynchronous API, served on completion queues of its own
// (the callback API serves every callback method from one shared queue).
class AsyncServiceHost {
 public:
  virtual ~AsyncServiceHost() = default;
  // How many completion queues the server adds for it.
  virtual int completion_queues() const = 0;
  // The server runs: serve its calls on `queues` (on threads of its own).
  virtual void StartServing(std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues) = 0;
  // The server has shut down (every call has ended or been cancelled): shut the queues down,
  // drain them and join the threads. Called once.
  virtual void StopServing() = 0;
};

struct GrpcServerOptions {
  // host:port to listen on; port 0 picks a free port.
  std::string listen_address = "127.0.0.1:0";
  // Largest message accepted or sent, in bytes.
  int max_message_bytes = 64 << 20;
  // Transport security (common/security/tls.h); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials{};
  // Services among `services` with asynchronous methods (not owned; they must outlive the
  // server).
  std::vector<AsyncServiceHost*> async_hosts{};
};

// Thread safety: all methods may be called from any thread.
class GrpcServer {
 public:
  // Builds and starts a server for `services` (not owned; they must outlive
  // the server). The health service reports the server ("") and each service
  // SERVING. UNAVAILABLE when the address cannot be bound.
  // `interceptors` wrap every call (e.g. request metrics).
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(
      const GrpcServerOptions& options, const std::vector<NamedService>& services,
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
          interceptors = {});

  ~GrpcServer();
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // The port actually bound.
  int port() const { return port_; }
  // host:port with the bound port, for clients.
  std::string address() const;
  // A channel to this server that skips the network stack.
  std::shared_ptr<grpc::Channel> InProcessChannel() const;

  // What the health service reports for the service `name` (a readiness probe's service); no-op
  // after Shutdown, which reports every service NOT_SERVING. Thread-safe.
  void SetServing(const std::string& name, bool serving);

  // Marks every service NOT_SERVING, then waits up to `grace` for calls in
  // flight before cancelling them; connections with no call in flight are
  // closed once the server has had none for kQuietBeforeClosing. Idempotent.
  void Shutdown(absl::Duration grace = absl::Seconds(5));

  static constexpr absl::Duration kQuietBeforeClosing = absl::Milliseconds(200);

 private:
  GrpcServer(std::unique_ptr<grpc::Server> server,
             std::shared_ptr<const std::atomic<int64_t>> calls, std::string host, int port,
             std::vector<AsyncServiceHost*> async_hosts);

  std::unique_ptr<grpc::Server> server_;
  // Calls in flight (an interceptor counts them).
  std::shared_ptr<const std::atomic<int64_t>> calls_;
  std::vector<AsyncServiceHost*> async_hosts_;
  std::string host_;
  int port_;
  std::atomic<bool> shut_down_{false};
};

// A client channel to host:port with `credentials` (common/security/tls.h);
// null: plaintext. With TLS, a non-empty `tls_server_name` is the name the
// server's certificate must carry instead of the address's host (workers are
// reached by pod IP but share one certificate naming the service).
std::shared_ptr<grpc::Channel> MakeClientChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
    const std::string& tls_server_name = "");

}  // namespace tessera
