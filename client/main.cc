// tessera: the command-line client of a Tessera coordinator.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"
#include "common/command_line.h"
#include "common/version.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "Coordinator gRPC address (host:port).");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call, e.g. 10s.");

namespace {

constexpr char kUsage[] =
    "The Tessera command-line client.\n\n"
    "Usage: tessera [--coordinator=HOST:PORT] COMMAND\n\n"
    "Commands:\n"
    "  health     ask the coordinator whether it serves (grpc.health.v1); exit 0 when it does\n"
    "  version    print this build's version\n";

int Health(tessera::client::CoordinatorClient& client) {
  auto serving = client.CheckHealth("tessera.v1.Coordinator");
  if (!serving.ok()) {
    std::cerr << "tessera: " << serving.status().message() << "\n";
    return 1;
  }
  std::cout << client.options().address << ": "
            << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*serving) << "\n";
  return *serving == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = tessera::ParseCommandLine(argc, argv, kUsage);
  if (args.size() != 2) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args[1];
  if (command == "version") {
    std::cout << tessera::BuildSummary() << "\n";
    return 0;
  }
  tessera::client::CoordinatorClient client(
      {.address = absl::GetFlag(FLAGS_coordinator), .timeout = absl::GetFlag(FLAGS_timeout)});
  if (command == "health") return Health(client);
  std::cerr << "tessera: unknown command '" << command << "'\n\n" << kUsage;
  return 2;
}
