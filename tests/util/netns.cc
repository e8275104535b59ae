#include "tests/util/netns.h"

#include <unistd.h>

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

NetnsLab::~NetnsLab() { Remove(); }

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
  return absl::OkStatus();
}

void NetnsLab::Remove() {
  // Best effort: what was never made fails to delete, which is fine. Removing the switch's
  // namespace removes this machine's cable with its peer.
  Shell(absl::StrCat("for ns in $(ip netns list | awk '{print $1}' | grep '^", prefix_,
                     "-'); do ip netns del $ns; done"))
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

absl::Status NetnsLab::Delay(int host, const std::string& netem_delay) {
  const std::string tc = absl::StrCat("ip netns exec ", names_[host], " tc qdisc ");
  if (netem_delay.empty()) return Shell(tc + "del dev eth0 root");
  if (absl::Status added = Shell(absl::StrCat(tc, "replace dev eth0 root netem delay ", netem_delay));
      !added.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("tc netem is not available in this kernel: ", added.message()));
  }
  return absl::OkStatus();
}

}  // namespace tessera::testing
