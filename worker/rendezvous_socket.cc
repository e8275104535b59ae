#include "worker/rendezvous_socket.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tessera::worker {
namespace {

// What TCPStore's own listener asks for.
constexpr int kBacklog = 2048;

}  // namespace

absl::StatusOr<RendezvousSocket> RendezvousSocket::Listen(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int error = getaddrinfo(host.c_str(), "0", &hints, &found); error != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous address '", host, "' does not resolve: ", gai_strerror(error)));
  }
  absl::Cleanup free_found = [found] { freeaddrinfo(found); };
  std::string last_error = "no address";
  for (const addrinfo* address = found; address != nullptr; address = address->ai_next) {
    const int fd = socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    if (bind(fd, address->ai_addr, address->ai_addrlen) != 0 || listen(fd, kBacklog) != 0) {
      const int error = errno;
      close(fd);
      if (error == EADDRNOTAVAIL) {
        return absl::FailedPreconditionError(absl::StrCat("cannot listen on ", host,
                                                          ": not an address of this machine (",
                                                          std::strerror(error), ")"));
      }
      last_error = std::strerror(error);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
      last_error = std::strerror(errno);
      close(fd);
      continue;
    }
    const int port = bound.ss_family == AF_INET6
                         ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                         : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    return RendezvousSocket(fd, port);
  }
  return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ": ", last_error));
}

RendezvousSocket::RendezvousSocket(RendezvousSocket&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), port_(other.port_) {}

RendezvousSocket& RendezvousSocket::operator=(RendezvousSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    port_ = other.port_;
  }
  return *this;
}

RendezvousSocket::~RendezvousSocket() {
  if (fd_ >= 0) close(fd_);
}

}  // namespace tessera::worker
