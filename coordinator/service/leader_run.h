// RunElectedCoordinator: the body of tessera-coordinator's main() when its state is in
// PostgreSQL and several coordinators may share it (the HA contract, docs/coordinator.md "High
// availability"). The process starts as a standby (standby_server.h) and polls the lease
// (leader_election.h); once it wins, it stops the standby's listeners, starts the full
// CoordinatorDaemon on the same ports (which loads the state from the store and reconciles with
// the workers' re-registrations, as after a restart) and serves until a signal. A leader that
// loses leadership logs "tessera-coordinator: lost leadership (epoch N, now M at ADDRESS)" and
// exits with kLostLeadershipExitCode at once: its supervisor restarts it, as a standby. A leader
// stopped by a signal releases the lease once its daemon is gone, so that a standby takes over at
// its next poll.
//
// Thread safety: called once, from main's thread, with SIGINT and SIGTERM blocked.
#pragma once

#include <string>

#include "absl/time/time.h"
#include "coordinator/service/coordinator_daemon.h"

namespace tessera::coordinator {

// The exit status of a leader that lost leadership (ha.md).
inline constexpr int kLostLeadershipExitCode = 3;

struct ElectionOptions {
  // What the other coordinators name as this one's address when it leads; empty: the bound
  // listen address.
  std::string advertise_address;
  // The lease's time to live; the leader renews every lease / 5.
  absl::Duration lease = absl::Seconds(5);
  // How often a standby tries to take the lease.
  absl::Duration standby_poll = absl::Seconds(1);
};

// main()'s exit status: 0 after a signal, 1 when the servers or the daemon cannot start (the
// message on stderr). Never returns once leadership is lost (exits kLostLeadershipExitCode).
int RunElectedCoordinator(CoordinatorOptions options, const ElectionOptions& election);

}  // namespace tessera::coordinator
