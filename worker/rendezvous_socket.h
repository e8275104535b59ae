// The rendezvous port of a job whose ranks all run on this node, chosen here: the worker binds a
// listening socket on a port the kernel picks and hands it to rank 0, whose TCPStore takes it
// over (c10d's masterListenFd). Nothing can take the port between the choice and the store's
// start, so another cluster's trainers on the same machine (a second coordinator's jobs, tests
// side by side, `tessera local`) never collide with this one's on a port.
//
// Thread-compatible: a RendezvousSocket is owned by one caller.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tessera::worker {

// The descriptor a trainer rank inherits the socket as (TrainerTask's
// RankAssignment.master_listen_fd): the first after stdin, stdout and stderr.
inline constexpr int kInheritedListenFd = 3;

// A bound, listening TCP socket; closed on destruction.
class RendezvousSocket {
 public:
  // Binds `host` (a numeric IPv4 or IPv6 address, or a name that resolves to one of this
  // machine's) on a port the kernel picks and listens. INVALID_ARGUMENT when `host` does not
  // resolve; the errno's status (e.g. FAILED_PRECONDITION for EADDRNOTAVAIL: not an address of
  // this machine) naming `host` when it cannot be bound.
  static absl::StatusOr<RendezvousSocket> Listen(const std::string& host);

  RendezvousSocket(RendezvousSocket&& other) noexcept;
  RendezvousSocket& operator=(RendezvousSocket&& other) noexcept;
  RendezvousSocket(const RendezvousSocket&) = delete;
  RendezvousSocket& operator=(const RendezvousSocket&) = delete;
  ~RendezvousSocket();

  int fd() const { return fd_; }
  int port() const { return port_; }

 private:
  RendezvousSocket(int fd, int port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace tessera::worker
