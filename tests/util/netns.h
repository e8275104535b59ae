// NetnsLab: a small network of "hosts" on this machine for partition and chaos tests. Each host
// is a Linux network namespace with one interface, eth0, addressed 10.<net>.0.<host + 1>/24 and
// cabled by a veth pair to a bridge that lives in a namespace of its own (the lab's switch), so
// the machine's own network is untouched but for one more veth: the test process itself, in the
// machine's namespace, reaches every host at its address through it (its own end is
// 10.<net>.0.254, and the route to the lab's /24 is the only route added). A process started on a host sees only that host's
// interfaces: a coordinator and two workers on three hosts talk over the bridge exactly as they
// would over a data-centre network, and the lab cuts, slows or drops that traffic:
//   - Partition(a, b): packets between hosts a and b are dropped both ways (iptables in both
//     namespaces), while each still reaches every other host; Heal(a, b) undoes it.
//   - Isolate(a): host a's cable is unplugged (its veth set down); Reconnect(a).
//   - SetLoss(a, 0.02): a random 2% of a's packets dropped each way (iptables' statistic match);
//     SetLoss(a, 0) removes it.
//   - LimitRate(a, "1mbit"): a's outgoing traffic shaped by tc's token bucket; "" removes it.
//   - Delay(a, 150ms, 20ms jitter): every packet a sends or receives arrives 150-170 ms late
//     (packet_delay.h: NFQUEUE, since the kernels here lack tc netem); Undelay(a) removes it.
// The lab needs root (CAP_NET_ADMIN) and the ip, iptables and tc commands; Create says why when
// it cannot build the network, and tests skip with that reason.
//
// Namespaces are named "<prefix>-sw" and "<prefix>-h<i>" with a prefix unique to the process, and
// removed by the destructor (the processes on them must be stopped first; a leftover lab of a
// killed test is removed by the next lab with the same prefix, which is keyed by pid).
//
// Thread safety: one thread at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/util/packet_delay.h"

namespace tessera::testing {

class NetnsLab {
 public:
  // Builds `hosts` hosts on a 10.<net>.0.0/24 subnet that no interface of this machine uses yet
  // (chosen from the process id, so that labs of concurrent tests differ).
  static absl::StatusOr<std::unique_ptr<NetnsLab>> Create(int hosts);

  ~NetnsLab();
  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;

  int hosts() const { return static_cast<int>(names_.size()); }
  // The namespace's name (for `ip netns exec`).
  const std::string& Namespace(int host) const { return names_[host]; }
  // The host's address, e.g. "10.77.0.2".
  std::string Ip(int host) const;
  // `argv` prefixed so that it runs on the host: {"ip", "netns", "exec", <ns>, argv...}. `ip netns
  // exec` replaces itself with the command, so a Subprocess started with it has the command's pid.
  std::vector<std::string> On(int host, const std::vector<std::string>& argv) const;

  absl::Status Partition(int a, int b);
  absl::Status Heal(int a, int b);
  // This machine's own address on the lab's network (10.<net>.0.254): daemons that stay in the
  // machine's namespace (e.g. coordinators next to a database on loopback) listen there.
  std::string MachineIp() const;
  // Like Partition(host, <this machine>): the host's packets to and from MachineIp() are dropped
  // (rules in the host's namespace only), while it still reaches every other host.
  absl::Status PartitionFromMachine(int host);
  absl::Status HealFromMachine(int host);
  absl::Status Isolate(int host);
  absl::Status Reconnect(int host);
  absl::Status SetLoss(int host, double fraction);
  absl::Status LimitRate(int host, const std::string& rate);
  // Latency on host's traffic, each way: the packets it receives and the packets it sends (to
  // `peer_ip` only, a host's Ip() or MachineIp(), or to everyone when empty) are held `delay`
  // plus a uniform draw from [0, jitter] (which reorders packets) on arrival, so a round trip
  // between host and a peer takes 2 * delay longer. TCP control and bulk traffic alike (gRPC,
  // Gloo). Packets are held at the receiving end only: held on the way out they would still count
  // against their socket's small-queue budget (TSQ), which throttles a delayed flow to a few
  // packets per delay. A second Delay of the host replaces the first.
  absl::Status Delay(int host, absl::Duration delay, absl::Duration jitter = absl::ZeroDuration(),
                     const std::string& peer_ip = "");
  absl::Status Undelay(int host);
  // Packets held and released so far for host's latency (0 when none is injected).
  int64_t DelayedPackets(int host) const;
  // A TCP socket made on `host` (in its namespace), to bind, listen or connect as that host would,
  // from any thread; the caller owns the descriptor.
  absl::StatusOr<int> TcpSocketOn(int host) const;
  // TcpSocketOn(host) connected to ip:port (blocking), e.g. for a client that must see the
  // network as that host does (grpc::CreateInsecureChannelFromFd).
  absl::StatusOr<int> ConnectFrom(int host, const std::string& ip, int port) const;

 private:
  NetnsLab(std::string prefix, int net) : prefix_(std::move(prefix)), net_(net) {}
  absl::Status Build(int hosts);
  // Adds (`flag` "-I") or deletes ("-D") the rules that drop a's traffic with b, on a's side.
  absl::Status DropRules(int a, int b, const std::string& flag);
  void Remove();
  // A namespace's path under /run/netns; "" for this machine's.
  std::string NamespacePath(int host) const;

  struct DelayRule {
    std::string iptables;  // "ip netns exec <ns> iptables -w -t mangle" or this machine's
    std::string rule;      // the rule after -A/-D
    std::unique_ptr<PacketDelayer> delayer;
  };

  std::string prefix_;
  int net_;
  std::vector<std::string> names_;
  // Per host: the loss rules in place (their probability), to delete them again.
  std::vector<std::string> loss_;
  // Per host: the latency rules and their delayers (empty when none).
  std::vector<std::vector<DelayRule>> delays_;
};

// Runs `command` with /bin/sh; INTERNAL naming it and its output when it fails.
absl::Status Shell(const std::string& command);

}  // namespace tessera::testing
