#include "tests/util/packet_delay.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter.h>
#include <linux/netfilter/nfnetlink.h>
#include <linux/netfilter/nfnetlink_queue.h>
#include <linux/netlink.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <queue>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tessera::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint16_t kQueueMessage(uint8_t message) {
  return static_cast<uint16_t>((NFNL_SUBSYS_QUEUE << 8) | message);
}

// Builds netlink messages of nfnetlink_queue: a header, the nfgenmsg naming the queue, and
// attributes, each padded to NLA_ALIGNTO.
class Message {
 public:
  Message(uint16_t type, uint16_t flags, uint16_t queue) {
    buffer_.resize(NLMSG_HDRLEN + NLMSG_ALIGN(sizeof(nfgenmsg)));
    auto* header = reinterpret_cast<nlmsghdr*>(buffer_.data());
    header->nlmsg_type = type;
    header->nlmsg_flags = flags;
    auto* generic = reinterpret_cast<nfgenmsg*>(buffer_.data() + NLMSG_HDRLEN);
    generic->nfgen_family = AF_UNSPEC;
    generic->version = NFNETLINK_V0;
    generic->res_id = htons(queue);
  }
  template <typename T>
  Message& Add(uint16_t type, const T& value) {
    const size_t at = buffer_.size();
    buffer_.resize(at + NLA_ALIGN(NLA_HDRLEN + sizeof(T)));
    auto* attribute = reinterpret_cast<nlattr*>(buffer_.data() + at);
    attribute->nla_type = type;
    attribute->nla_len = NLA_HDRLEN + sizeof(T);
    std::memcpy(buffer_.data() + at + NLA_HDRLEN, &value, sizeof(T));
    return *this;
  }
  // The finished message (its length filled in).
  const std::vector<char>& Bytes() {
    reinterpret_cast<nlmsghdr*>(buffer_.data())->nlmsg_len = buffer_.size();
    return buffer_;
  }

 private:
  std::vector<char> buffer_;
};

// Sends a configuration message and waits for the kernel's acknowledgement.
absl::Status Configure(int fd, Message message, const std::string& what) {
  const std::vector<char>& bytes = message.Bytes();
  if (send(fd, bytes.data(), bytes.size(), 0) < 0) {
    return absl::InternalError(absl::StrCat(what, ": send: ", std::strerror(errno)));
  }
  char reply[4096];
  const ssize_t n = recv(fd, reply, sizeof(reply), 0);
  if (n < 0) return absl::InternalError(absl::StrCat(what, ": recv: ", std::strerror(errno)));
  const auto* header = reinterpret_cast<const nlmsghdr*>(reply);
  if (!NLMSG_OK(header, static_cast<size_t>(n)) || header->nlmsg_type != NLMSG_ERROR) {
    return absl::InternalError(absl::StrCat(what, ": unexpected reply"));
  }
  const int error = -reinterpret_cast<const nlmsgerr*>(NLMSG_DATA(header))->error;
  if (error != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": ", std::strerror(error),
                     error == EBUSY ? " (the queue is bound by another process)" : ""));
  }
  return absl::OkStatus();
}

// A netlink socket of nfnetlink_queue made in the namespace at `netns_path`: setns affects only
// the calling thread, so a short-lived thread of its own enters the namespace and makes it (a
// socket stays in the namespace it was made in).
absl::StatusOr<int> QueueSocketIn(const std::string& netns_path) {
  absl::StatusOr<int> result = absl::InternalError("not run");
  std::thread([&] {
    if (!netns_path.empty()) {
      const int ns = open(netns_path.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0) {
        result = absl::FailedPreconditionError(
            absl::StrCat("cannot open ", netns_path, ": ", std::strerror(errno)));
        return;
      }
      const int entered = setns(ns, CLONE_NEWNET);
      const int setns_errno = errno;
      close(ns);
      if (entered != 0) {
        result = absl::FailedPreconditionError(
            absl::StrCat("cannot enter ", netns_path, ": ", std::strerror(setns_errno)));
        return;
      }
    }
    const int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_NETFILTER);
    if (fd < 0) {
      result = absl::FailedPreconditionError(
          absl::StrCat("no netfilter netlink socket: ", std::strerror(errno)));
      return;
    }
    result = fd;
  }).join();
  return result;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PacketDelayer>> PacketDelayer::Start(
    const std::string& netns_path, uint16_t queue, const PacketDelayOptions& options) {
  absl::StatusOr<int> fd = QueueSocketIn(netns_path);
  if (!fd.ok()) return fd.status();
  auto fail = [&](absl::Status status) {
    close(*fd);
    return status;
  };
  sockaddr_nl local{};
  local.nl_family = AF_NETLINK;
  if (bind(*fd, reinterpret_cast<sockaddr*>(&local), sizeof(local)) != 0) {
    return fail(absl::InternalError(absl::StrCat("bind: ", std::strerror(errno))));
  }
  // Room for bursts: a message per packet, held until this thread reads them.
  const int buffer = 16 << 20;
  if (setsockopt(*fd, SOL_SOCKET, SO_RCVBUFFORCE, &buffer, sizeof(buffer)) != 0) {
    setsockopt(*fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
  }
  // ENOBUFS on overrun is harmless here (fail-open accepts what the queue cannot hold).
  const int one = 1;
  setsockopt(*fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof(one));

  const uint16_t config = kQueueMessage(NFQNL_MSG_CONFIG);
  const uint16_t request = NLM_F_REQUEST | NLM_F_ACK;
  nfqnl_msg_config_cmd bind_command{};
  bind_command.command = NFQNL_CFG_CMD_BIND;
  bind_command.pf = htons(AF_INET);
  if (absl::Status bound =
          Configure(*fd, Message(config, request, queue).Add(NFQA_CFG_CMD, bind_command),
                    absl::StrCat("bind NFQUEUE ", queue));
      !bound.ok()) {
    return fail(bound);
  }
  nfqnl_msg_config_params params{};
  params.copy_range = htonl(0);
  params.copy_mode = NFQNL_COPY_META;
  const uint32_t fail_open = htonl(NFQA_CFG_F_FAIL_OPEN);
  if (absl::Status set = Configure(*fd,
                                   Message(config, request, queue)
                                       .Add(NFQA_CFG_PARAMS, params)
                                       .Add(NFQA_CFG_QUEUE_MAXLEN, htonl(options.max_queued))
                                       .Add(NFQA_CFG_FLAGS, fail_open)
                                       .Add(NFQA_CFG_MASK, fail_open),
                                   "configure the queue");
      !set.ok()) {
    return fail(set);
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) return fail(absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno))));
  std::unique_ptr<PacketDelayer> delayer(new PacketDelayer(*fd, wake, queue, options));
  delayer->thread_ = std::thread([raw = delayer.get()] { raw->Loop(); });
  return delayer;
}

PacketDelayer::~PacketDelayer() {
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // The thread then ends at its next wake-up, at most a delay later.
  }
  if (thread_.joinable()) thread_.join();
  // Closing unbinds the queue; the rules' --queue-bypass lets later packets pass undelayed.
  close(fd_);
  close(wake_fd_);
}

void PacketDelayer::Loop() {
  // Held packets by due time (earliest first); the id orders equal times as they came.
  using Held = std::pair<Clock::time_point, uint32_t>;
  std::priority_queue<Held, std::vector<Held>, std::greater<Held>> held;
  std::mt19937_64 rng(options_.seed);
  const auto delay = absl::ToChronoNanoseconds(options_.delay);
  const int64_t jitter_ns = absl::ToInt64Nanoseconds(options_.jitter);
  std::vector<char> verdicts;
  auto accept = [&](uint32_t id) {
    nfqnl_msg_verdict_hdr verdict{};
    verdict.verdict = htonl(NF_ACCEPT);
    verdict.id = htonl(id);
    Message message(kQueueMessage(NFQNL_MSG_VERDICT), NLM_F_REQUEST, queue_);
    const std::vector<char>& bytes = message.Add(NFQA_VERDICT_HDR, verdict).Bytes();
    verdicts.insert(verdicts.end(), bytes.begin(), bytes.end());
  };
  auto flush = [&] {
    // Several verdicts in one datagram: the kernel handles each message in turn.
    // A verdict the kernel refuses (the packet gone with its queue) has nothing left to release.
    if (!verdicts.empty()) send(fd_, verdicts.data(), verdicts.size(), 0);
    verdicts.clear();
  };
  std::vector<char> buffer(1 << 16);
  bool stopping = false;
  while (!stopping) {
    int timeout_ms = -1;
    if (!held.empty()) {
      const auto wait = held.top().first - Clock::now();
      timeout_ms = std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(wait).count());
    }
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, timeout_ms) < 0 && errno != EINTR) break;
    if (fds[1].revents & POLLIN) stopping = true;
    if (fds[0].revents & POLLIN) {
      // Everything queued now, without blocking.
      for (;;) {
        const ssize_t n = recv(fd_, buffer.data(), buffer.size(), MSG_DONTWAIT);
        if (n <= 0) break;
        const Clock::time_point now = Clock::now();
        size_t left = static_cast<size_t>(n);
        for (auto* header = reinterpret_cast<nlmsghdr*>(buffer.data()); NLMSG_OK(header, left);
             header = NLMSG_NEXT(header, left)) {
          if (header->nlmsg_type != kQueueMessage(NFQNL_MSG_PACKET)) continue;
          const size_t prefix = NLMSG_ALIGN(sizeof(nfgenmsg));
          auto* attribute =
              reinterpret_cast<nlattr*>(static_cast<char*>(NLMSG_DATA(header)) + prefix);
          int attributes_left =
              static_cast<int>(header->nlmsg_len) - NLMSG_HDRLEN - static_cast<int>(prefix);
          while (attributes_left >= NLA_HDRLEN && attribute->nla_len >= NLA_HDRLEN &&
                 attribute->nla_len <= attributes_left) {
            if ((attribute->nla_type & NLA_TYPE_MASK) == NFQA_PACKET_HDR) {
              nfqnl_msg_packet_hdr packet;
              std::memcpy(&packet, reinterpret_cast<char*>(attribute) + NLA_HDRLEN, sizeof(packet));
              const int64_t extra =
                  jitter_ns > 0 ? std::uniform_int_distribution<int64_t>(0, jitter_ns)(rng) : 0;
              held.push({now + delay + std::chrono::nanoseconds(extra), ntohl(packet.packet_id)});
              break;
            }
            attributes_left -= NLA_ALIGN(attribute->nla_len);
            attribute = reinterpret_cast<nlattr*>(reinterpret_cast<char*>(attribute) +
                                                  NLA_ALIGN(attribute->nla_len));
          }
        }
      }
    }
    // Due packets go on; when stopping, every held packet does.
    const Clock::time_point now = Clock::now();
    int64_t accepted = 0;
    while (!held.empty() && (stopping || held.top().first <= now)) {
      accept(held.top().second);
      held.pop();
      ++accepted;
      if (verdicts.size() > 32 * 1024) flush();
    }
    flush();
    delayed_.fetch_add(accepted);
  }
}

}  // namespace tessera::testing
