// RunElectedCoordinator (leader_run.h): standby, election, then the daemon. Thread safety as
// the header says.
#include "coordinator/service/leader_run.h"

#include <signal.h>
#include <time.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/daemon/daemon_servers.h"
#include "common/security/daemon_security.h"
#include "coordinator/ha/standby_server.h"
#include "coordinator/store/leader_election.h"
#include "coordinator/store/postgres_database.h"

namespace tessera::coordinator {
namespace {

constexpr char kBinary[] = "tessera-coordinator";

// The signal (SIGINT, SIGTERM) that arrived within `timeout`; 0 when none did.
int WaitForSignal(absl::Duration timeout) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  const timespec wait = absl::ToTimespec(timeout);
  const int signal_number = sigtimedwait(&signals, nullptr, &wait);
  return signal_number > 0 ? signal_number : 0;
}

// As Store::Open reads --database_password_file: its first line.
absl::StatusOr<std::string> ReadPassword(const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream file(path);
  std::string password;
  if (!file || !std::getline(file, password) || password.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("database password file '", path, "' cannot be read or is empty"));
  }
  if (password.back() == '\r') password.pop_back();
  return password;
}

// "HOST:PORT" of `address` with its port replaced by `port`.
std::string WithPort(const std::string& address, int port) {
  const size_t colon = address.rfind(':');
  return absl::StrCat(colon == std::string::npos ? address : address.substr(0, colon), ":", port);
}

}  // namespace

int RunElectedCoordinator(CoordinatorOptions options, const ElectionOptions& election_options) {
  auto fail = [](const absl::Status& status) {
    std::cerr << kBinary << ": " << status << std::endl;
    return 1;
  };
  auto credentials = DaemonServerCredentials(kBinary, options.listen_address, options.security,
                                             ClientCertPolicy::kRequestAndVerify);
  if (!credentials.ok()) return fail(credentials.status());
  auto standby = StandbyServer::Start({.listen_address = options.listen_address,
                                       .metrics_listen_address = options.metrics_listen_address,
                                       .advertise_address = election_options.advertise_address,
                                       .credentials = *credentials,
                                       .health_listen_address = options.health_listen_address});
  if (!standby.ok()) return fail(standby.status());
  std::cerr << kBinary << ": standby serving gRPC on " << (*standby)->address();
  if ((*standby)->metrics_port() > 0)
    std::cerr << ", metrics on port " << (*standby)->metrics_port();
  if ((*standby)->health_port() > 0)
    std::cerr << ", health on port " << (*standby)->health_port();
  std::cerr << " as " << (*standby)->advertise_address() << std::endl;

  auto password = ReadPassword(options.database_password_file);
  if (!password.ok()) return fail(password.status());
  auto election = LeaderElection::Connect({.url = options.state_path,
                                           .password = *password,
                                           .advertise_address = (*standby)->advertise_address(),
                                           .holder = "",
                                           .lease = election_options.lease,
                                           .renew_interval = absl::ZeroDuration(),
                                           .connect_timeout_seconds = 10});
  if (!election.ok()) return fail(election.status());

  std::string last_error;
  while (true) {
    absl::StatusOr<bool> acquired = (*election)->TryAcquire();
    if (acquired.ok() && *acquired) break;
    if (acquired.ok()) {
      absl::StatusOr<LeaderInfo> leader = (*election)->Current();
      if (leader.ok()) (*standby)->SetLeader(leader->epoch, leader->live ? leader->address : "");
    } else if (std::string error(acquired.status().message()); error != last_error) {
      // The database is away: keep polling, say so once per distinct error.
      std::cerr << kBinary << ": standby: " << error << std::endl;
      last_error = error;
    }
    if (int signal_number = WaitForSignal(election_options.standby_poll); signal_number != 0) {
      std::cerr << kBinary << ": signal " << signal_number << ", shutting down" << std::endl;
      return 0;
    }
  }
  // From here on a lost lease ends the process: nothing a deposed leader does may count.
  (*election)->StartRenewing([](const std::string& message) {
    std::cerr << kBinary << ": " << message << std::endl;
    std::_Exit(kLostLeadershipExitCode);
  });
  // The same ports the standby had (a port 0 was bound by it already): clients and probes keep
  // their address.
  options.listen_address = (*standby)->address();
  if ((*standby)->metrics_port() > 0) {
    options.metrics_listen_address =
        WithPort(options.metrics_listen_address, (*standby)->metrics_port());
  }
  if ((*standby)->health_port() > 0) {
    options.health_listen_address =
        WithPort(options.health_listen_address, (*standby)->health_port());
  }
  (*standby)->Shutdown();
  options.election = election->get();
  std::cerr << kBinary << ": leading with epoch " << (*election)->epoch() << " as "
            << (*election)->advertise_address() << "; loading the state" << std::endl;
  auto daemon = CoordinatorDaemon::Start(options);
  if (!daemon.ok()) return fail(daemon.status());
  const int code =
      ServeUntilSignal(kBinary, (*daemon)->servers(), [&daemon] { (*daemon)->PrepareShutdown(); });
  // The daemon's last write is done once it is gone; then the lease can go to a standby now
  // rather than after it expires.
  daemon->reset();
  if (absl::Status released = (*election)->Release(); !released.ok()) {
    std::cerr << kBinary << ": releasing the leader lease: " << released.message() << std::endl;
  }
  return code;
}

}  // namespace tessera::coordinator
