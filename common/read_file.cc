#include "common/read_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"

namespace tessera {

absl::Status ReadFileChunks(const std::string& path, size_t chunk_bytes,
                            const std::function<void(const char* data, size_t size)>& consume) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  std::vector<char> buffer(chunk_bytes);
  while (true) {
    ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": read"));
    }
    if (n == 0) return absl::OkStatus();
    consume(buffer.data(), static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::string out;
  absl::Status status = ReadFileChunks(
      path, size_t{64} << 10, [&](const char* data, size_t size) { out.append(data, size); });
  if (!status.ok()) return status;
  return out;
}

absl::StatusOr<std::string> FileIdentity(const std::string& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": stat"));
  return absl::StrCat(info.st_ino, ":", info.st_size, ":", info.st_mtim.tv_sec, ".",
                      info.st_mtim.tv_nsec);
}

}  // namespace tessera
