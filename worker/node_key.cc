#include "worker/node_key.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/read_file.h"
#include "common/status_macros.h"

namespace tessera::worker {
namespace {

constexpr size_t kKeyBytes = 32;

bool IsHexKey(const std::string& text) {
  if (text.size() != 2 * kKeyBytes) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(c)) return false;
  }
  return true;
}

absl::StatusOr<std::string> ReadKey(const std::string& path) {
  struct stat info {};
  if (stat(path.c_str(), &info) != 0) return ErrnoToStatus(errno, path);
  if ((info.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": readable by others (mode ", absl::StrCat(info.st_mode & 0777),
                     "); chmod 600 it"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  std::string key(absl::StripAsciiWhitespace(text));
  if (!IsHexKey(key)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": not a node key (", 2 * kKeyBytes,
                     " hex digits); remove it to make a new one (the node then needs its old "
                     "registration to expire, LOST, before it can register again)"));
  }
  return key;
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateNodeKey(const std::string& work_dir) {
  std::error_code error;
  std::filesystem::create_directories(work_dir, error);
  if (error) return absl::InternalError(absl::StrCat(work_dir, ": ", error.message()));
  const std::string path = (std::filesystem::path(work_dir) / kNodeKeyFile).string();
  if (access(path.c_str(), F_OK) == 0) return ReadKey(path);

  unsigned char bytes[kKeyBytes];
  size_t filled = 0;
  while (filled < kKeyBytes) {
    ssize_t got = getrandom(bytes + filled, kKeyBytes - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "getrandom");
    }
    filled += static_cast<size_t>(got);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string key;
  for (unsigned char byte : bytes) {
    key.push_back(kHex[byte >> 4]);
    key.push_back(kHex[byte & 15]);
  }
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoToStatus(errno, temp);
  const std::string line = key + "\n";
  bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                 fsync(fd) == 0;
  const int write_errno = errno;
  close(fd);
  if (!written) {
    unlink(temp.c_str());
    return ErrnoToStatus(write_errno, temp);
  }
  // link() fails if another worker created the key first: then both use that one.
  if (link(temp.c_str(), path.c_str()) != 0 && errno != EEXIST) {
    const int link_errno = errno;
    unlink(temp.c_str());
    return ErrnoToStatus(link_errno, path);
  }
  unlink(temp.c_str());
  return ReadKey(path);
}

}  // namespace tessera::worker
