#include "tests/util/netns.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tests/util/subprocess.h"

namespace tessera::testing {

absl::Status Shell(const std::string& command) {
  ASSIGN_OR_RETURN(RunResult result, RunCommand({"/bin/sh", "-c", command}, absl::Seconds(30)));
  if (result.exit.exit_code != 0) {
    return absl::InternalError(
        absl::StrCat("`", command, "` exited ", result.exit.exit_code, ": ", result.output));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NetnsLab>> NetnsLab::Create(int hosts) {
  if (geteuid() != 0) {
    return absl::FailedPreconditionError(
        "network namespaces need root (CAP_NET_ADMIN); run the chaos tests as root, as CI does");
  }
  for (const char* tool : {"ip", "iptables", "tc"}) {
    if (!Shell(absl::StrCat("command -v ", tool, " > /dev/null")).ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(tool, " is not installed (scripts/bootstrap.sh installs iproute2 and "
                             "iptables)"));
    }
  }
  // A subnet this machine has no address in (its own networks, and concurrent tests' labs).
  int net = 0;
  for (int i = 0; i < 100 && net == 0; ++i) {
    const int candidate = 100 + (getpid() + i) % 100;
    if (!Shell(absl::StrCat("ip -4 addr | grep -q ' 10\\.", candidate, "\\.'")).ok()) {
      net = candidate;
    }
  }
  if (net == 0) return absl::FailedPreconditionError("no free 10.N.0.0/24 subnet for a test network");
  // Short: interface and namespace names stay readable in `ip netns list`.
  std::unique_ptr<NetnsLab> lab(new NetnsLab(absl::StrCat("tsr", getpid()), net));
  lab->Remove();  // a lab of an earlier process with this pid that was killed
  if (absl::Status built = lab->Build(hosts); !built.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot build the test network: ", built.message()));
  }
  return lab;
}

NetnsLab::~NetnsLab() {
  for (int host = 0; host < hosts(); ++host) {
    if (absl::Status undone = Undelay(host); !undone.ok()) {
      std::cerr << "test network: " << undone << std::endl;
    }
  }
  Remove();
}

std::string NetnsLab::Ip(int host) const { return absl::StrCat("10.", net_, ".0.", host + 1); }

std::vector<std::string> NetnsLab::On(int host, const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"/usr/sbin/ip", "netns", "exec", names_[host]};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

absl::Status NetnsLab::Build(int hosts) {
  const std::string sw = prefix_ + "-sw";
  RETURN_IF_ERROR(Shell(absl::StrCat("ip netns add ", sw)));
  RETURN_IF_ERROR(Shell(absl::StrCat("ip -n ", sw, " link add br0 type bridge && ip -n ", sw,
                                     " link set br0 up")));
  for (int h = 0; h < hosts; ++h) {
    const std::string ns = absl::StrCat(prefix_, "-h", h);
    RETURN_IF_ERROR(Shell(absl::StrCat("ip netns add ", ns)));
    names_.push_back(ns);
    // One cable: eth0 on the host, port<h> on the switch's bridge.
    RETURN_IF_ERROR(Shell(absl::StrCat("ip link add eth0 netns ", ns, " type veth peer name port",
                                       h, " netns ", sw)));
    RETURN_IF_ERROR(Shell(absl::StrCat("ip -n ", sw, " link set port", h, " master br0 up")));
    RETURN_IF_ERROR(Shell(absl::StrCat("ip -n ", ns, " addr add ", Ip(h), "/24 dev eth0 && ip -n ",
                                       ns, " link set eth0 up && ip -n ", ns, " link set lo up")));
  }
  // This machine's own cable, for the test process.
  RETURN_IF_ERROR(Shell(absl::StrCat("ip link add ", prefix_, " type veth peer name portx netns ",
                                     sw, " && ip -n ", sw, " link set portx master br0 up && ip addr add 10.",
                                     net_, ".0.254/24 dev ", prefix_, " && ip link set ", prefix_,
                                     " up")));
  // The bridge runs no spanning tree, so its ports forward as soon as they are up.
  loss_.assign(hosts, "");
  delays_.resize(hosts);
  return absl::OkStatus();
}

void NetnsLab::Remove() {
  // Best effort: what was never made fails to delete, which is fine. Removing the switch's
  // namespace removes this machine's cable with its peer.
  Shell(absl::StrCat("for ns in $(ip netns list | awk '{print $1}' | grep '^", prefix_,
                     "-'); do ip netns del $ns; done"))
      .IgnoreError();
  // Latency rules of a killed test's lab on this machine's side (their --queue-bypass lets
  // packets pass, but they would delay this lab's own traffic if a delayer bound their queue).
  Shell(absl::StrCat("iptables -w -t mangle -S PREROUTING | grep -- '-i ", prefix_,
                     " ' | sed 's/^-A //' | while read -r rule; do iptables -w -t mangle -D $rule; "
                     "done"))
      .IgnoreError();
}

absl::Status NetnsLab::DropRules(int a, int b, const std::string& flag) {
  const std::string exec = absl::StrCat("ip netns exec ", names_[a], " iptables -w ");
  return Shell(absl::StrCat(exec, flag, " INPUT -s ", Ip(b), " -j DROP && ", exec, flag,
                            " OUTPUT -d ", Ip(b), " -j DROP"));
}

absl::Status NetnsLab::Partition(int a, int b) {
  RETURN_IF_ERROR(DropRules(a, b, "-I"));
  return DropRules(b, a, "-I");
}

absl::Status NetnsLab::Heal(int a, int b) {
  RETURN_IF_ERROR(DropRules(a, b, "-D"));
  return DropRules(b, a, "-D");
}

std::string NetnsLab::MachineIp() const { return absl::StrCat("10.", net_, ".0.254"); }

absl::Status NetnsLab::PartitionFromMachine(int host) {
  const std::string exec = absl::StrCat("ip netns exec ", names_[host], " iptables -w ");
  return Shell(absl::StrCat(exec, "-I INPUT -s ", MachineIp(), " -j DROP && ", exec,
                            "-I OUTPUT -d ", MachineIp(), " -j DROP"));
}

absl::Status NetnsLab::HealFromMachine(int host) {
  const std::string exec = absl::StrCat("ip netns exec ", names_[host], " iptables -w ");
  return Shell(absl::StrCat(exec, "-D INPUT -s ", MachineIp(), " -j DROP && ", exec,
                            "-D OUTPUT -d ", MachineIp(), " -j DROP"));
}

absl::Status NetnsLab::Isolate(int host) {
  return Shell(absl::StrCat("ip -n ", names_[host], " link set eth0 down"));
}

absl::Status NetnsLab::Reconnect(int host) {
  return Shell(absl::StrCat("ip -n ", names_[host], " link set eth0 up"));
}

absl::Status NetnsLab::SetLoss(int host, double fraction) {
  const std::string exec = absl::StrCat("ip netns exec ", names_[host], " iptables -w ");
  auto rules = [&](const std::string& flag, const std::string& probability) {
    return Shell(absl::StrCat(exec, flag, " INPUT -i eth0 -m statistic --mode random --probability ",
                              probability, " -j DROP && ", exec, flag,
                              " OUTPUT -o eth0 -m statistic --mode random --probability ",
                              probability, " -j DROP"));
  };
  if (!loss_[host].empty()) {
    RETURN_IF_ERROR(rules("-D", loss_[host]));
    loss_[host].clear();
  }
  if (fraction <= 0) return absl::OkStatus();
  const std::string probability = absl::StrCat(fraction);
  RETURN_IF_ERROR(rules("-A", probability));
  loss_[host] = probability;
  return absl::OkStatus();
}

absl::Status NetnsLab::LimitRate(int host, const std::string& rate) {
  const std::string tc = absl::StrCat("ip netns exec ", names_[host], " tc qdisc ");
  if (rate.empty()) return Shell(tc + "del dev eth0 root");
  return Shell(absl::StrCat(tc, "replace dev eth0 root tbf rate ", rate,
                            " burst 32kbit latency 400ms"));
}

std::string NetnsLab::NamespacePath(int host) const {
  return host < 0 ? "" : absl::StrCat("/run/netns/", names_[host]);
}

absl::Status NetnsLab::Delay(int host, absl::Duration delay, absl::Duration jitter,
                             const std::string& peer_ip) {
  if (host < 0 || host >= hosts()) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", host));
  }
  if (delay <= absl::ZeroDuration() || jitter < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("delay ", absl::FormatDuration(delay),
                                                   " and jitter ", absl::FormatDuration(jitter),
                                                   ": the delay must be positive"));
  }
  RETURN_IF_ERROR(Undelay(host));
  // One queue number per delayed host, the same in every namespace; this machine's namespace is
  // shared with concurrent tests' labs, whose subnets (net_) differ.
  const uint16_t queue = static_cast<uint16_t>(net_ * 16 + host);
  PacketDelayOptions options;
  options.delay = delay;
  options.jitter = jitter;
  // Where a packet of host's is received, and which: on host, all it receives (from peer_ip);
  // on each peer (another host or this machine), what it receives from host.
  struct Side {
    int ns;  // a host, or -1 for this machine
    std::string in_interface;
    std::string source;
  };
  std::vector<Side> sides = {{host, "eth0", peer_ip}};
  for (int other = -1; other < hosts(); ++other) {
    if (other == host) continue;
    const std::string ip = other < 0 ? MachineIp() : Ip(other);
    if (!peer_ip.empty() && peer_ip != ip) continue;
    sides.push_back({other, other < 0 ? prefix_ : "eth0", Ip(host)});
  }
  if (sides.size() == 1 && !peer_ip.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(peer_ip, " is no address of this network"));
  }
  for (const Side& side : sides) {
    DelayRule rule;
    rule.iptables = side.ns < 0 ? "iptables -w -t mangle "
                                : absl::StrCat("ip netns exec ", names_[side.ns],
                                               " iptables -w -t mangle ");
    rule.rule = absl::StrCat("PREROUTING -i ", side.in_interface,
                             side.source.empty() ? "" : " -s " + side.source,
                             " -j NFQUEUE --queue-num ", queue, " --queue-bypass");
    options.seed = static_cast<uint64_t>(queue) * 1000 + side.ns + 1;
    auto delayer = PacketDelayer::Start(NamespacePath(side.ns), queue, options);
    if (!delayer.ok()) {
      Undelay(host).IgnoreError();
      return absl::FailedPreconditionError(
          absl::StrCat("cannot delay packets (NFQUEUE): ", delayer.status().message()));
    }
    rule.delayer = std::move(*delayer);
    // The delayer first: the rule's --queue-bypass lets packets through until it is bound.
    if (absl::Status added = Shell(rule.iptables + "-A " + rule.rule); !added.ok()) {
      Undelay(host).IgnoreError();
      return absl::FailedPreconditionError(
          absl::StrCat("cannot add the latency rule: ", added.message()));
    }
    delays_[host].push_back(std::move(rule));
  }
  return absl::OkStatus();
}

absl::Status NetnsLab::Undelay(int host) {
  if (host < 0 || host >= hosts()) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", host));
  }
  absl::Status result;
  // Rules first, so that no packet is queued to a delayer that is gone; a delayer's end releases
  // what it still holds.
  for (DelayRule& rule : delays_[host]) {
    result.Update(Shell(rule.iptables + "-D " + rule.rule));
  }
  delays_[host].clear();
  return result;
}

int64_t NetnsLab::DelayedPackets(int host) const {
  int64_t total = 0;
  for (const DelayRule& rule : delays_[host]) total += rule.delayer->delayed();
  return total;
}

absl::StatusOr<int> NetnsLab::TcpSocketOn(int host) const {
  if (host < 0 || host >= hosts()) {
    return absl::InvalidArgumentError(absl::StrCat("no host ", host));
  }
  // setns changes the calling thread's namespace only: a thread of its own makes the socket, which
  // stays on the host whichever thread uses it.
  absl::StatusOr<int> result = absl::InternalError("not run");
  std::thread([&] {
    const int ns = open(NamespacePath(host).c_str(), O_RDONLY | O_CLOEXEC);
    if (ns < 0 || setns(ns, CLONE_NEWNET) != 0) {
      result = absl::InternalError(
          absl::StrCat("cannot enter ", names_[host], ": ", std::strerror(errno)));
      if (ns >= 0) close(ns);
      return;
    }
    close(ns);
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      result = absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
      return;
    }
    result = fd;
  }).join();
  return result;
}

absl::StatusOr<int> NetnsLab::ConnectFrom(int host, const std::string& ip, int port) const {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, ip.c_str(), &address.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("not an IPv4 address: ", ip));
  }
  ASSIGN_OR_RETURN(const int fd, TcpSocketOn(host));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    const int connect_errno = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to ", ip, ":", port, " from ",
                                               names_[host], ": ", std::strerror(connect_errno)));
  }
  return fd;
}

}  // namespace tessera::testing
