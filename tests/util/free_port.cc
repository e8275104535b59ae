#include "tests/util/free_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/errno_status.h"
#include "common/scoped_fd.h"

namespace tessera::testing {

absl::StatusOr<int> PickFreePort() {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return ErrnoToStatus(errno, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, "bind 127.0.0.1:0");
  }
  socklen_t length = sizeof(addr);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    return ErrnoToStatus(errno, "getsockname");
  }
  return ntohs(addr.sin_port);
}

}  // namespace tessera::testing
