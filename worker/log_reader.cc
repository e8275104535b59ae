#include "worker/log_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"

namespace tessera::worker {
namespace {

// Block size of the backward scan for line starts.
constexpr int64_t kTailScanBlock = 64 * 1024;

// pread that retries on EINTR; returns the byte count or -1 with errno set.
ssize_t PreadFully(int fd, char* buffer, size_t size, int64_t offset) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = pread(fd, buffer + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(done);
}

}  // namespace

absl::StatusOr<int64_t> TailOffset(int fd, int64_t size, int lines) {
  if (lines <= 0 || size <= 0) return 0;
  std::string block;
  // The newline ending the last line does not start a line after it.
  int64_t end = size;
  int newlines_seen = 0;
  bool skip_final_newline = true;
  while (end > 0) {
    const int64_t begin = std::max<int64_t>(0, end - kTailScanBlock);
    block.resize(static_cast<size_t>(end - begin));
    ssize_t n = PreadFully(fd, block.data(), block.size(), begin);
    if (n < 0) return ErrnoToStatus(errno, "reading a log file");
    if (static_cast<size_t>(n) != block.size()) {
      return absl::DataLossError("log file shrank while looking for its last lines");
    }
    for (int64_t i = end - 1; i >= begin; --i) {
      if (block[static_cast<size_t>(i - begin)] != '\n') {
        skip_final_newline = false;
        continue;
      }
      if (skip_final_newline) {
        skip_final_newline = false;
        continue;
      }
      if (++newlines_seen == lines) return i + 1;
    }
    end = begin;
  }
  return 0;
}

absl::StatusOr<LogReader> LogReader::Open(const std::string& path, int tail_lines) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat("log file not found: ", path));
    return ErrnoToStatus(error, absl::StrCat("opening log file ", path));
  }
  LogReader reader(fd, path, 0);
  struct stat info;
  if (fstat(fd, &info) != 0) return ErrnoToStatus(errno, absl::StrCat("stat of log file ", path));
  absl::StatusOr<int64_t> start = TailOffset(fd, info.st_size, tail_lines);
  if (!start.ok()) {
    return absl::Status(start.status().code(),
                        absl::StrCat(start.status().message(), " (", path, ")"));
  }
  reader.offset_ = *start;
  return reader;
}

LogReader::LogReader(LogReader&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), offset_(other.offset_) {}

LogReader& LogReader::operator=(LogReader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    offset_ = other.offset_;
  }
  return *this;
}

LogReader::~LogReader() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::string> LogReader::ReadMore(size_t max_bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError("log reader was moved from");
  struct stat info;
  if (fstat(fd_, &info) != 0) return ErrnoToStatus(errno, absl::StrCat("stat of log ", path_));
  if (info.st_size < offset_) offset_ = 0;  // Truncated: what is there now is all new.
  const int64_t available = info.st_size - offset_;
  std::string data(static_cast<size_t>(std::min<int64_t>(available, max_bytes)), '\0');
  if (data.empty()) return data;
  ssize_t n = PreadFully(fd_, data.data(), data.size(), offset_);
  if (n < 0) return ErrnoToStatus(errno, absl::StrCat("reading log ", path_));
  data.resize(static_cast<size_t>(n));
  offset_ += n;
  return data;
}

}  // namespace tessera::worker
