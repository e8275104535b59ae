#include "common/daemon/metrics_exposer.h"

#include <exception>
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
  return std::unique_ptr<MetricsExposer>(
      new MetricsExposer(std::move(exposer), std::move(registry), port));
}

MetricsExposer::MetricsExposer(std::unique_ptr<prometheus::Exposer> exposer,
                               std::shared_ptr<prometheus::Registry> registry, int port)
    : exposer_(std::move(exposer)), registry_(std::move(registry)), port_(port) {}

}  // namespace tessera
