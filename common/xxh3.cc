#include "common/xxh3.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"

namespace tessera {
namespace {

constexpr size_t kReadChunkBytes = 4 << 20;
// How far ahead of the chunk being hashed the kernel is asked to read, so that the disk works
// while the CPU hashes (one pass, I/O and hashing overlapped).
constexpr off_t kReadAheadBytes = 32 << 20;

std::string Hex(XXH128_hash_t hash) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(canonical.digest), sizeof(canonical.digest)));
}

}  // namespace

absl::StatusOr<std::string> Xxh3File(const std::string& path) {
  auto hasher = Xxh3Hasher::Create();
  if (!hasher.ok()) return hasher.status();
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(kReadChunkBytes);
  off_t offset = 0;
  off_t advised = 0;
  while (true) {
    if (advised < offset + kReadAheadBytes) {
      ::posix_fadvise(fd.get(), advised, offset + 2 * kReadAheadBytes - advised,
                      POSIX_FADV_WILLNEED);
      advised = offset + 2 * kReadAheadBytes;
    }
    const ssize_t n = ::read(fd.get(), buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": read"));
    }
    if (n == 0) break;
    offset += n;
    hasher->Update(buffer.data(), static_cast<size_t>(n));
  }
  return hasher->HexDigest();
}

std::string Xxh3Hex(std::string_view bytes) {
  return Hex(XXH3_128bits(bytes.data(), bytes.size()));
}

absl::StatusOr<Xxh3Hasher> Xxh3Hasher::Create() {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr || XXH3_128bits_reset(state) != XXH_OK) {
    XXH3_freeState(state);
    return absl::ResourceExhaustedError("cannot create an XXH3 state");
  }
  return Xxh3Hasher(state);
}

Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&& other) noexcept : state_(other.state_) {
  other.state_ = nullptr;
}

Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&& other) noexcept {
  if (this != &other) {
    XXH3_freeState(state_);
    state_ = other.state_;
    other.state_ = nullptr;
  }
  return *this;
}

Xxh3Hasher::~Xxh3Hasher() { XXH3_freeState(state_); }

void Xxh3Hasher::Update(const void* data, size_t size) { XXH3_128bits_update(state_, data, size); }

std::string Xxh3Hasher::HexDigest() const { return Hex(XXH3_128bits_digest(state_)); }

}  // namespace tessera
