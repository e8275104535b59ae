#include "common/sealed_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/errno_status.h"
#include "common/status_macros.h"

namespace tessera {
namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;

// A read-only shared mapping of `size` bytes of `fd` (none for 0 bytes). `populate`
// (MAP_POPULATE) where the reader goes through every page anyway: one populate is cheaper than a
// fault per page.
absl::StatusOr<const char*> MapReadOnly(int fd, size_t size, bool populate = true) {
  if (size == 0) return nullptr;
  void* data = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (data == MAP_FAILED) return ErrnoToStatus(errno, "mmap of a sealed memory file");
  return static_cast<const char*>(data);
}

}  // namespace

SealedMemory::SealedMemory(SealedMemory&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

SealedMemory& SealedMemory::operator=(SealedMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

SealedMemory::~SealedMemory() { Reset(); }

void SealedMemory::Reset() {
  if (data_ != nullptr) ::munmap(const_cast<char*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
}

std::string SealedMemory::ProcPath() const { return absl::StrCat("/proc/self/fd/", fd_); }

absl::StatusOr<SealedMemory::Writer> SealedMemory::Writer::Start(const char* name, size_t size) {
  const int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("memfd_create ", name));
  Writer writer(name, fd, nullptr, 0);  // closes fd on every early return
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memory file ", name, " of ", size, " bytes: ", std::strerror(errno)));
  }
  if (size > 0) {
    void* writable = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (writable == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mmap of memory file ", name, ": ", std::strerror(errno)));
    }
    writer.writable_ = static_cast<char*>(writable);
  }
  writer.size_ = size;
  return writer;
}

SealedMemory::Writer::Writer(Writer&& other) noexcept
    : name_(std::move(other.name_)),
      fd_(std::exchange(other.fd_, -1)),
      writable_(std::exchange(other.writable_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

SealedMemory::Writer& SealedMemory::Writer::operator=(Writer&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
    writable_ = std::exchange(other.writable_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

SealedMemory::Writer::~Writer() { Reset(); }

void SealedMemory::Writer::Reset() {
  if (writable_ != nullptr) ::munmap(writable_, size_);
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  writable_ = nullptr;
  size_ = 0;
}

absl::StatusOr<SealedMemory> SealedMemory::Writer::Seal() && {
  // F_SEAL_WRITE needs every writable mapping gone.
  if (writable_ != nullptr) ::munmap(std::exchange(writable_, nullptr), size_);
  SealedMemory memory(std::exchange(fd_, -1), nullptr, 0);  // closes the file on an error
  const size_t size = std::exchange(size_, 0);
  if (::fcntl(memory.fd_, F_ADD_SEALS, kSeals) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("sealing memory file ", name_));
  }
  absl::StatusOr<const char*> data = MapReadOnly(memory.fd_, size);
  if (!data.ok()) return data.status();
  memory.data_ = *data;
  memory.size_ = size;
  return memory;
}

absl::StatusOr<SealedMemory> SealedMemory::Create(
    const char* name, size_t size, absl::FunctionRef<absl::Status(char* data)> fill) {
  ASSIGN_OR_RETURN(Writer writer, Writer::Start(name, size));
  RETURN_IF_ERROR(fill(writer.data()));
  return std::move(writer).Seal();
}

absl::StatusOr<SealedMemory> SealedMemory::Copy(const char* name, std::string_view bytes) {
  return Create(name, bytes.size(), [&](char* data) {
    if (!bytes.empty()) std::memcpy(data, bytes.data(), bytes.size());
    return absl::OkStatus();
  });
}

absl::StatusOr<SealedMemory> SealedMemory::CopyOfFile(const char* name, int file_fd, size_t size) {
  const int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("memfd_create ", name));
  SealedMemory memory(fd, nullptr, 0);  // closes fd on every early return
  // The kernel copies from the file's page cache into the memory file's pages: no mapping of
  // them here, so no page fault per page (about half the time of a pread into a mapping).
  off_t offset = 0;
  while (static_cast<size_t>(offset) < size) {
    const ssize_t n = ::sendfile(fd, file_fd, &offset, size - static_cast<size_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      if (error == ENOSPC || error == ENOMEM) {
        return absl::ResourceExhaustedError(
            absl::StrCat("memory file ", name, " of ", size, " bytes: ", std::strerror(error)));
      }
      return ErrnoToStatus(error, absl::StrCat("copying into memory file ", name));
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat("copying into memory file ", name,
                                              ": the file ended after ", offset, " of ", size,
                                              " bytes"));
    }
  }
  if (::fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("sealing memory file ", name));
  }
  absl::StatusOr<const char*> data = MapReadOnly(fd, size, /*populate=*/false);
  if (!data.ok()) return data.status();
  memory.data_ = *data;
  memory.size_ = size;
  return memory;
}

absl::StatusOr<SealedMemory> SealedMemory::Adopt(int fd) {
  SealedMemory memory(fd, nullptr, 0);  // closes fd on every early return
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE)) !=
                       (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE)) {
    return absl::FailedPreconditionError(
        seals < 0 ? absl::StrCat("the descriptor received is not a memory file: ",
                                 std::strerror(errno))
                  : "the memory file received is not sealed against writes and resizing");
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) return ErrnoToStatus(errno, "fstat of a received memory file");
  const size_t size = static_cast<size_t>(info.st_size);
  absl::StatusOr<const char*> data = MapReadOnly(fd, size);
  if (!data.ok()) return data.status();
  memory.data_ = *data;
  memory.size_ = size;
  return memory;
}

}  // namespace tessera
