#include "tests/util/http_get.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tessera::testing {
namespace {

class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path, absl::Duration timeout) {
  Socket sock(socket(AF_INET, SOCK_STREAM, 0));
  if (sock.fd() < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(sock.fd(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect 127.0.0.1:", port, ": ", strerror(errno)));
  }
  std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(sock.fd(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return absl::UnavailableError(absl::StrCat("send: ", strerror(errno)));
  }
  std::string raw;
  absl::Time deadline = absl::Now() + timeout;
  char buffer[8192];
  while (true) {
    int wait_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (wait_ms <= 0) return absl::DeadlineExceededError("HTTP GET timed out");
    pollfd pfd{sock.fd(), POLLIN, 0};
    if (poll(&pfd, 1, wait_ms) <= 0) continue;
    ssize_t n = recv(sock.fd(), buffer, sizeof(buffer), 0);
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", strerror(errno)));
    if (n == 0) break;
    raw.append(buffer, static_cast<size_t>(n));
  }
  size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("no HTTP header end");
  std::vector<std::string> status_line = absl::StrSplit(raw.substr(0, raw.find("\r\n")), ' ');
  HttpResponse response;
  if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &response.status_code)) {
    return absl::DataLossError(absl::StrCat("bad status line in: ", raw.substr(0, 80)));
  }
  response.body = raw.substr(header_end + 4);
  return response;
}

}  // namespace tessera::testing
