#include "worker/rendezvous_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <utility>

#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::worker {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;

// Whether a TCP connection to 127.0.0.1:`port` is accepted (by the kernel's backlog).
bool Connects(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool connected = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  close(fd);
  return connected;
}

TEST(RendezvousSocketTest, ListensOnAPortOfItsOwnUntilDestroyed) {
  absl::StatusOr<RendezvousSocket> first = RendezvousSocket::Listen("127.0.0.1");
  absl::StatusOr<RendezvousSocket> second = RendezvousSocket::Listen("127.0.0.1");
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_GT(first->port(), 0);
  EXPECT_NE(first->port(), second->port());
  EXPECT_TRUE(Connects(first->port()));
  const int port = second->port();
  EXPECT_TRUE(Connects(port));
  // Moved: the new owner keeps it listening; destroyed: the port is free again.
  std::optional<RendezvousSocket> moved(std::move(*second));
  EXPECT_EQ(moved->port(), port);
  EXPECT_TRUE(Connects(port));
  moved.reset();
  EXPECT_FALSE(Connects(port));
}

TEST(RendezvousSocketTest, TheSocketIsNotInheritedByAccident) {
  absl::StatusOr<RendezvousSocket> socket = RendezvousSocket::Listen("127.0.0.1");
  ASSERT_THAT(socket, IsOk());
  EXPECT_EQ(fcntl(socket->fd(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST(RendezvousSocketTest, AnAddressOfAnotherMachineOrNoneIsRefusedByName) {
  // 192.0.2.1 (TEST-NET-1) belongs to no machine.
  EXPECT_THAT(RendezvousSocket::Listen("192.0.2.1"),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::HasSubstr("192.0.2.1")));
  EXPECT_THAT(
      RendezvousSocket::Listen("no-such-host.invalid"),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("no-such-host.invalid")));
}

}  // namespace
}  // namespace tessera::worker
