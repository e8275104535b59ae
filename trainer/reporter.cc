#include "trainer/reporter.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

absl::StatusOr<std::unique_ptr<SocketReporter>> SocketReporter::Connect(const std::string& path) {
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
  return std::unique_ptr<SocketReporter>(new SocketReporter(fd));
}

SocketReporter::~SocketReporter() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) close(fd_);
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
  if (fd_ < 0) return absl::UnavailableError("report socket closed");
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int error = errno;
      close(fd_);
      fd_ = -1;
      return absl::UnavailableError(absl::StrCat("report socket: ", strerror(error)));
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace tessera::trainer
