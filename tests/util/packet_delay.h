// PacketDelayer: latency for the test networks (netns.h) on kernels without tc netem. iptables
// rules in a host's namespace hand its packets to an NFQUEUE queue (nfnetlink_queue); a
// PacketDelayer bound to that queue holds each packet for the delay (plus a uniform jitter, which
// may reorder packets, as netem's does) and then accepts it, so the packet goes on through the
// kernel unchanged. Only the packets' metadata crosses into this process, never their payload.
// Everything the rules select is delayed: TCP control traffic (gRPC) and bulk traffic (Gloo)
// alike, with the kernel's own retransmission and congestion control seeing the delay.
//
// The rules should use --queue-bypass, so that packets pass undelayed when no delayer is bound
// (e.g. the test process was killed); the delayer also asks the kernel to accept rather than drop
// packets when its queue is full (fail-open), so a burst larger than the queue loses no packet.
//
// Thread safety: the delayer runs one thread of its own; its public methods may be called from
// any thread. Destroying it accepts every packet it still holds.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::testing {

struct PacketDelayOptions {
  // Added to every packet the queue receives.
  absl::Duration delay = absl::Milliseconds(100);
  // Each packet is held delay + a uniform draw from [0, jitter].
  absl::Duration jitter = absl::ZeroDuration();
  // Packets held at most at a time; more are accepted at once (fail-open).
  uint32_t max_queued = 1 << 16;
  uint64_t seed = 1;
};

class PacketDelayer {
 public:
  // Binds NFQUEUE queue `queue` in the network namespace at `netns_path` (e.g.
  // /run/netns/<name>; "" for this process's own) and starts holding its packets. An error when
  // the namespace or the queue cannot be opened (FAILED_PRECONDITION: no nfnetlink_queue in the
  // kernel, not root, or the queue already bound by another process).
  static absl::StatusOr<std::unique_ptr<PacketDelayer>> Start(const std::string& netns_path,
                                                              uint16_t queue,
                                                              const PacketDelayOptions& options);
  ~PacketDelayer();
  PacketDelayer(const PacketDelayer&) = delete;
  PacketDelayer& operator=(const PacketDelayer&) = delete;

  // Packets accepted after their delay so far.
  int64_t delayed() const { return delayed_.load(); }

 private:
  PacketDelayer(int fd, int wake_fd, uint16_t queue, const PacketDelayOptions& options)
      : fd_(fd), wake_fd_(wake_fd), queue_(queue), options_(options) {}
  void Loop();

  const int fd_;
  const int wake_fd_;
  const uint16_t queue_;
  const PacketDelayOptions options_;
  std::atomic<int64_t> delayed_{0};
  std::thread thread_;
};

}  // namespace tessera::testing
