#include "bench/control_plane_prometheus.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"

namespace tessera::bench {
namespace {

// Sends an HTTP/1.0 GET and returns everything the server sent until it
// closed the connection.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path, absl::Duration timeout) {
  ScopedFd sock(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) return ErrnoToStatus(errno, "socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", strerror(errno)));
  }
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(sock.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return ErrnoToStatus(errno, absl::StrCat("send to 127.0.0.1:", port));
  }
  std::string raw;
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[16384];
  while (true) {
    const int wait_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (wait_ms <= 0) {
      return absl::DeadlineExceededError(absl::StrCat("GET 127.0.0.1:", port, path, ": no end in ",
                                                      absl::FormatDuration(timeout)));
    }
    pollfd pfd{sock.get(), POLLIN, 0};
    if (poll(&pfd, 1, wait_ms) <= 0) continue;
    const ssize_t n = recv(sock.get(), buffer, sizeof(buffer), 0);
    if (n < 0) return ErrnoToStatus(errno, absl::StrCat("recv from 127.0.0.1:", port));
    if (n == 0) return raw;
    raw.append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace

absl::StatusOr<MetricSamples> ScrapeMetrics(int port, absl::Duration timeout) {
  auto raw = HttpGet(port, "/metrics", timeout);
  if (!raw.ok()) return raw.status();
  const size_t header_end = raw->find("\r\n\r\n");
  if (raw->rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos) {
    return absl::DataLossError(
        absl::StrCat("/metrics on port ", port, ": not an HTTP response: ", raw->substr(0, 80)));
  }
  if (raw->compare(raw->find(' ') + 1, 3, "200") != 0) {
    return absl::UnavailableError(
        absl::StrCat("/metrics on port ", port, ": ", raw->substr(0, raw->find("\r\n"))));
  }
  MetricSamples samples;
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(*raw).substr(header_end + 4), '\n')) {
    if (line.empty() || line[0] == '#') continue;
    // The value follows the last space; label values may hold spaces.
    const size_t space = line.rfind(' ');
    double value = 0;
    if (space == absl::string_view::npos || !absl::SimpleAtod(line.substr(space + 1), &value)) {
      continue;
    }
    samples[std::string(line.substr(0, space))] = value;
  }
  return samples;
}

HistogramTotals HistogramIn(const MetricSamples& samples, const std::string& name,
                            const std::string& labels) {
  const std::string suffix = labels.empty() ? "" : absl::StrCat("{", labels, "}");
  HistogramTotals totals;
  if (auto it = samples.find(absl::StrCat(name, "_sum", suffix)); it != samples.end()) {
    totals.sum = it->second;
  }
  if (auto it = samples.find(absl::StrCat(name, "_count", suffix)); it != samples.end()) {
    totals.count = it->second;
  }
  return totals;
}

HistogramTotals Difference(const HistogramTotals& after, const HistogramTotals& before) {
  return {after.sum - before.sum, after.count - before.count};
}

}  // namespace tessera::bench
