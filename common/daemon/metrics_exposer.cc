#include "common/daemon/metrics_exposer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "prometheus/gauge.h"

namespace tessera {

absl::StatusOr<std::unique_ptr<MetricsExposer>> MetricsExposer::Start(
    const MetricsExposerOptions& options) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildGauge()
      .Name("tessera_build_info")
      .Help("Build of the running Tessera daemon; the value is always 1")
      .Register(*registry)
      .Add({{"component", options.component}, {"version", Version()}})
      .Set(1);

  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // civetweb takes "host:port"; it throws when it cannot bind.
    exposer = std::make_unique<prometheus::Exposer>(options.listen_address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", options.listen_address, ": ", e.what()));
  }
  exposer->RegisterCollectable(registry);
  std::vector<int> ports = exposer->GetListeningPorts();
  int port = ports.empty() ? 0 : ports.front();
  std::string host = options.listen_address.substr(0, options.listen_address.rfind(':'));
  in_addr parsed{};
  if (host.empty() || host == "0.0.0.0" || inet_pton(AF_INET, host.c_str(), &parsed) != 1) {
    host = "127.0.0.1";
  }
  return std::unique_ptr<MetricsExposer>(
      new MetricsExposer(std::move(exposer), std::move(registry), port, std::move(host)));
}

MetricsExposer::MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer,
                               std::shared_ptr<prometheus::Registry> registry, int port,
                               std::string host)
    : exposer_(std::move(exposer)),
      registry_(std::move(registry)),
      port_(port),
      wake_host_(std::move(host)) {}

MetricsExposer::~MetricsExposer() {
  if (port_ <= 0) return;
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    inet_pton(AF_INET, wake_host_.c_str(), &addr.sin_addr);
    while (!stopped.load()) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd >= 0) {
        connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));  // only to wake it
        close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();
  stopped.store(true);
  waker.join();
}

}  // namespace tessera
