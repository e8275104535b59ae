// MetricsExposer: serves a prometheus-cpp registry on HTTP /metrics, and
// always includes tessera_build_info{version,commit...} so a dashboard can
// tell which build it is looking at.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"

namespace tessera {

struct MetricsExposerOptions {
  // host:port of the HTTP listener; port 0 picks a free port.
  std::string listen_address = "127.0.0.1:0";
  // Value of the `component` label of tessera_build_info ("coordinator", ...).
  std::string component;
};

// Thread safety: registry() may be used from any thread (prometheus-cpp
// metrics are thread-safe).
class MetricsExposer {
 public:
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsExposer>> Start(
      const MetricsExposerOptions& options);

  // Where metrics of the daemon are registered.
  prometheus::Registry& registry() { return *registry_; }
  // The port actually bound.
  int port() const { return port_; }
  // Serves `collectable` beside the registry while it lives.
  void RegisterCollectable(const std::weak_ptr<prometheus::Collectable>& collectable) {
    exposer_->RegisterCollectable(collectable);
  }

  // Stops the HTTP server at once: civetweb's listener thread notices the stop only when its
  // poll() returns, after up to a second, so the destructor connects to the port until it has.
  ~MetricsExposer();

 private:
  MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer,
                 std::shared_ptr<prometheus::Registry> registry, int port, std::string host);

  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  int port_;
  // An IPv4 address the listener answers on, to wake it (127.0.0.1 for a wildcard).
  std::string wake_host_;
};

}  // namespace tessera
