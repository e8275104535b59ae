// The test network's latency (NetnsLab::Delay over tests/util/packet_delay.h) on its own, with
// plain TCP sockets made on the hosts: a round trip with a delayed host takes 2 * delay longer,
// only on the paths asked for; jitter spreads it; a bulk transfer is not throttled to a few
// packets per delay; Undelay restores the network. Needs root (network namespaces, NFQUEUE);
// skips otherwise with the reason.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/util/netns.h"

namespace tessera {
namespace {

constexpr int kMachine = -1;
// What the bulk transfer moves.
constexpr size_t kBytes = 4 << 20;

class LatencyLabTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto lab = testing::NetnsLab::Create(3);
    if (!lab.ok()) GTEST_SKIP() << lab.status().message();
    lab_ = std::move(*lab);
  }
  void TearDown() override {
    for (int fd : fds_) close(fd);
  }

  int Keep(int fd) {
    timeval timeout{.tv_sec = 20, .tv_usec = 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    fds_.push_back(fd);
    return fd;
  }

  std::string IpOf(int host) const { return host == kMachine ? lab_->MachineIp() : lab_->Ip(host); }

  // A listening socket on `host` (kMachine: this machine's side); returns its port.
  int Listen(int host, int* listener) {
    int fd = -1;
    if (host == kMachine) {
      fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    } else {
      auto made = lab_->TcpSocketOn(host);
      EXPECT_TRUE(made.ok()) << made.status();
      if (!made.ok()) return 0;
      fd = *made;
    }
    Keep(fd);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    inet_pton(AF_INET, IpOf(host).c_str(), &address.sin_addr);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(listen(fd, 16), 0);
    socklen_t length = sizeof(address);
    getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
    *listener = fd;
    return ntohs(address.sin_port);
  }

  // A connection from `from` (a host) to `to`: {client, server}.
  std::pair<int, int> Connect(int from, int to) {
    int listener = -1;
    const int port = Listen(to, &listener);
    auto client = lab_->ConnectFrom(from, IpOf(to), port);
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return {-1, -1};
    const int server = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    EXPECT_GE(server, 0);
    return {Keep(*client), Keep(server)};
  }

  // One application-level round trip over a connection: a byte there and back.
  static absl::Duration RoundTrip(std::pair<int, int> connection) {
    char byte = 'x';
    const absl::Time start = absl::Now();
    if (send(connection.first, &byte, 1, 0) != 1 || recv(connection.second, &byte, 1, 0) != 1 ||
        send(connection.second, &byte, 1, 0) != 1 || recv(connection.first, &byte, 1, 0) != 1) {
      ADD_FAILURE() << "round trip failed";
      return absl::InfiniteDuration();
    }
    return absl::Now() - start;
  }

  // The fastest of a few round trips from `from` to `to` on one connection.
  absl::Duration BestRoundTrip(int from, int to, int tries = 3) {
    const std::pair<int, int> connection = Connect(from, to);
    absl::Duration best = absl::InfiniteDuration();
    for (int i = 0; i < tries; ++i) best = std::min(best, RoundTrip(connection));
    return best;
  }

  std::unique_ptr<testing::NetnsLab> lab_;
  std::vector<int> fds_;
};

TEST_F(LatencyLabTest, ARoundTripWithADelayedHostTakesTwiceTheDelayLonger) {
  const absl::Duration delay = absl::Milliseconds(100);
  EXPECT_LT(BestRoundTrip(1, kMachine), absl::Milliseconds(50)) << "before any latency";

  ASSERT_TRUE(lab_->Delay(1, delay).ok());
  for (int peer : {kMachine, 0, 2}) {
    const absl::Duration rtt = BestRoundTrip(1, peer);
    EXPECT_GE(rtt, 2 * delay) << "host 1 with " << IpOf(peer);
    EXPECT_LT(rtt, 2 * delay + absl::Milliseconds(100)) << "host 1 with " << IpOf(peer);
  }
  // Paths without host 1 keep their speed.
  EXPECT_LT(BestRoundTrip(0, 2), absl::Milliseconds(50));
  EXPECT_LT(BestRoundTrip(2, kMachine), absl::Milliseconds(50));
  EXPECT_GT(lab_->DelayedPackets(1), 0);

  ASSERT_TRUE(lab_->Undelay(1).ok());
  EXPECT_LT(BestRoundTrip(1, kMachine), absl::Milliseconds(50)) << "after Undelay";
  EXPECT_EQ(lab_->DelayedPackets(1), 0);
}

TEST_F(LatencyLabTest, APeerAddressLimitsTheDelayToThatPath) {
  const absl::Duration delay = absl::Milliseconds(100);
  ASSERT_TRUE(lab_->Delay(1, delay, absl::ZeroDuration(), lab_->Ip(2)).ok());
  EXPECT_GE(BestRoundTrip(1, 2), 2 * delay);
  EXPECT_GE(BestRoundTrip(2, 1), 2 * delay);
  EXPECT_LT(BestRoundTrip(1, kMachine), absl::Milliseconds(50));
  EXPECT_LT(BestRoundTrip(1, 0), absl::Milliseconds(50));

  EXPECT_FALSE(lab_->Delay(1, delay, absl::ZeroDuration(), "192.0.2.1").ok())
      << "an address outside the network";
  EXPECT_FALSE(lab_->Delay(1, absl::ZeroDuration()).ok());
}

TEST_F(LatencyLabTest, JitterSpreadsTheRoundTrips) {
  const absl::Duration delay = absl::Milliseconds(40);
  const absl::Duration jitter = absl::Milliseconds(80);
  ASSERT_TRUE(lab_->Delay(1, delay, jitter).ok());
  const std::pair<int, int> connection = Connect(1, kMachine);
  std::vector<absl::Duration> rtts;
  for (int i = 0; i < 12; ++i) rtts.push_back(RoundTrip(connection));
  std::sort(rtts.begin(), rtts.end());
  EXPECT_GE(rtts.front(), 2 * delay);
  EXPECT_LT(rtts.back(), 2 * (delay + jitter) + absl::Milliseconds(100));
  // Each of the two ways draws from [0, 80 ms]: twelve round trips within 20 ms of each other
  // would mean the jitter was not applied.
  EXPECT_GT(rtts.back() - rtts.front(), absl::Milliseconds(20))
      << absl::FormatDuration(rtts.front()) << " to " << absl::FormatDuration(rtts.back());
}

TEST_F(LatencyLabTest, ABulkTransferIsNotThrottledToAFewPacketsPerDelay) {
  const absl::Duration delay = absl::Milliseconds(100);
  ASSERT_TRUE(lab_->Delay(1, delay).ok());
  const auto [client, server] = Connect(1, kMachine);
  const absl::Time start = absl::Now();
  std::thread reader([server = server] {
    std::vector<char> buffer(1 << 16);
    size_t received = 0;
    while (received < kBytes) {
      const ssize_t n = recv(server, buffer.data(), buffer.size(), 0);
      if (n <= 0) break;
      received += n;
    }
    EXPECT_EQ(received, kBytes);
  });
  const std::vector<char> data(kBytes, 'y');
  size_t sent = 0;
  while (sent < kBytes) {
    const ssize_t n = send(client, data.data() + sent, kBytes - sent, 0);
    if (n <= 0) break;
    sent += n;
  }
  reader.join();
  const absl::Duration took = absl::Now() - start;
  // Held on the way out, each flow would move two packets per delay (its small-queue budget):
  // 4 MiB in about 150 s. Held on arrival, TCP grows its window over the 200 ms round trip.
  EXPECT_LT(took, absl::Seconds(8)) << "4 MiB over a 200 ms round trip";
  std::cout << "4 MiB over a 200 ms round trip: " << absl::FormatDuration(took) << std::endl;
}

}  // namespace
}  // namespace tessera
