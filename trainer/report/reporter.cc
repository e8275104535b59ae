#include "trainer/report/reporter.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/json_util.h"

namespace tessera::trainer {

absl::Status JsonLinesReporter::Send(const v1::TrainerReport& report) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  auto status = google::protobuf::util::MessageToJsonString(report, &json, options);
  if (!status.ok()) return absl::InternalError(status.ToString());
  absl::MutexLock lock(&mu_);
  out_ << json << "\n";
  out_.flush();
  return absl::OkStatus();
}

void ExitBecauseWorkerGone() {
  std::cerr << "tessera-trainer: worker gone (report socket closed); exiting" << std::endl;
  // The worker spawns each trainer as the leader of its own group; a trainer started some
  // other way must not take its launcher's group down with it.
  kill(getpgrp() == getpid() ? 0 : getpid(), SIGKILL);
  _exit(1);  // not reached: SIGKILL cannot be caught
}

absl::StatusOr<std::unique_ptr<SocketReporter>> SocketReporter::Connect(
    const std::string& path, SocketReporterOptions options) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("report_socket: path too long: ", path));
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int error = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("report_socket ", path, ": cannot connect: ", strerror(error)));
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("pipe: ", strerror(error)));
  }
  std::unique_ptr<SocketReporter> reporter(new SocketReporter(fd, wake[0], wake[1]));
  if (options.on_worker_gone) {
    reporter->watcher_ =
        std::thread([raw = reporter.get(), action = std::move(options.on_worker_gone)]() mutable {
          raw->Watch(std::move(action));
        });
  }
  return reporter;
}

SocketReporter::SocketReporter(int fd, int wake_read, int wake_write)
    : fd_(fd), wake_read_(wake_read), wake_write_(wake_write) {}

SocketReporter::~SocketReporter() {
  close(wake_write_);  // the watch thread sees POLLHUP on the pipe and returns
  if (watcher_.joinable()) watcher_.join();
  close(wake_read_);
  close(fd_);
}

void SocketReporter::Watch(std::function<void()> on_worker_gone) {
  while (true) {
    pollfd fds[2] = {{fd_, POLLIN | POLLRDHUP, 0}, {wake_read_, POLLIN, 0}};
    const int ready = poll(fds, 2, -1);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return;  // cannot watch; the pdeathsig and the pid file remain
    }
    if (fds[1].revents != 0) return;  // destruction
    if ((fds[0].revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) break;
    if ((fds[0].revents & POLLIN) != 0) {
      // The worker never writes: readable means end of stream (0) or an error.
      char byte;
      const ssize_t n = recv(fd_, &byte, 1, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;
    }
  }
  on_worker_gone();
}

absl::Status SocketReporter::Send(const v1::TrainerReport& report) {
  std::string frame;
  {
    google::protobuf::io::StringOutputStream stream(&frame);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteVarint32(static_cast<uint32_t>(report.ByteSizeLong()));
    report.SerializeWithCachedSizes(&coded);
  }
  absl::MutexLock lock(&mu_);
  if (broken_) return absl::UnavailableError("report socket closed");
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int error = errno;
      // Kept open for the watch thread; a partial frame would corrupt the stream anyway.
      shutdown(fd_, SHUT_WR);
      broken_ = true;
      return absl::UnavailableError(absl::StrCat("report socket: ", strerror(error)));
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer
