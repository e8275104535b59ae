#include "bench/checkpoint_bench_files.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"

namespace tessera::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point start, Clock::time_point end) {
  return std::chrono::duration<double>(end - start).count();
}

// User + system CPU seconds this process has used so far, all threads.
double ProcessCpuSeconds() {
  struct rusage usage;
  ::getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

absl::Status FsyncDirectory(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": fsync"));
  return absl::OkStatus();
}

// Evicts the file's pages from the page cache. They are clean (both sides
// fsync before this), which is what POSIX_FADV_DONTNEED needs to drop them.
absl::Status DropFromPageCache(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  if (::fdatasync(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": fdatasync"));
  if (int error = ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED); error != 0) {
    return ErrnoToStatus(error, absl::StrCat(path, ": posix_fadvise(DONTNEED)"));
  }
  return absl::OkStatus();
}

// Fraction of the file's pages in the page cache (mincore of a mapping).
absl::StatusOr<double> ResidentFraction(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  struct stat info;
  if (::fstat(fd.get(), &info) != 0) return ErrnoToStatus(errno, path);
  if (info.st_size == 0) return 0.0;
  const size_t size = static_cast<size_t>(info.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (map == MAP_FAILED) return ErrnoToStatus(errno, absl::StrCat(path, ": mmap"));
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> resident((size + page - 1) / page);
  const int rc = ::mincore(map, size, resident.data());
  const int error = errno;
  ::munmap(map, size);
  if (rc != 0) return ErrnoToStatus(error, absl::StrCat(path, ": mincore"));
  const auto in_cache = std::count_if(resident.begin(), resident.end(),
                                      [](unsigned char flags) { return (flags & 1) != 0; });
  return static_cast<double>(in_cache) / static_cast<double>(resident.size());
}

}  // namespace

double PhaseTimes::Total() const {
  double total = 0;
  for (const auto& [name, seconds] : phases) total += seconds;
  return total;
}

PhaseClock::PhaseClock() : last_(Clock::now()), cpu_start_(ProcessCpuSeconds()) {}

void PhaseClock::Lap(std::string phase) {
  const Clock::time_point now = Clock::now();
  times_.phases.emplace_back(std::move(phase), SecondsBetween(last_, now));
  last_ = now;
}

PhaseTimes PhaseClock::Take() && {
  times_.cpu_seconds = ProcessCpuSeconds() - cpu_start_;
  return std::move(times_);
}

absl::StatusOr<PhaseTimes> WritePlain(const std::string& path, const std::string& bytes) {
  PhaseClock clock;
  ScopedFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  size_t written = 0;
  while (written < bytes.size()) {
    const size_t block = std::min(kPlainBlockBytes, bytes.size() - written);
    const ssize_t n = ::write(fd.get(), bytes.data() + written, block);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": write"));
    }
    written += static_cast<size_t>(n);
  }
  clock.Lap("write");
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": fsync"));
  if (!fd.Close()) return ErrnoToStatus(errno, absl::StrCat(path, ": close"));
  RETURN_IF_ERROR(FsyncDirectory(std::filesystem::path(path).parent_path().string()));
  clock.Lap("fsync");
  return std::move(clock).Take();
}

absl::StatusOr<PhaseTimes> ReadPlain(const std::string& path, std::string* buffer) {
  PhaseClock clock;
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  size_t done = 0;
  while (true) {
    const size_t block = std::min(kPlainBlockBytes, buffer->size() - done);
    if (block == 0) break;
    const ssize_t n = ::read(fd.get(), buffer->data() + done, block);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat(path, ": read"));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  clock.Lap("read");
  if (done != buffer->size()) {
    return absl::DataLossError(
        absl::StrCat(path, ": read ", done, " bytes, expected ", buffer->size()));
  }
  return std::move(clock).Take();
}

absl::StatusOr<double> DropTreeFromPageCache(const std::string& dir) {
  double worst = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir, error)) {
    if (!entry.is_regular_file()) continue;
    const std::string path = entry.path().string();
    RETURN_IF_ERROR(DropFromPageCache(path));
    ASSIGN_OR_RETURN(double resident, ResidentFraction(path));
    worst = std::max(worst, resident);
  }
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot list: ", error.message()));
  return worst;
}

absl::Status SettleFileSystem(const std::string& dir) {
  ScopedFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, dir);
  if (::syncfs(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(dir, ": syncfs"));
  return absl::OkStatus();
}

absl::Status PrefaultFreeMemory(size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  void* memory =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
             /*fd=*/-1, /*offset=*/0);
  if (memory == MAP_FAILED) {
    return ErrnoToStatus(errno, absl::StrCat("mmap of ", bytes, " bytes to prefault"));
  }
  ::munmap(memory, bytes);
  return absl::OkStatus();
}

std::string FileSystemType(const std::string& path) {
  struct statfs info;
  if (::statfs(path.c_str(), &info) != 0) return "unknown";
  switch (static_cast<uint64_t>(info.f_type)) {
    case EXT4_SUPER_MAGIC:  // also ext2 and ext3
      return "ext2/3/4";
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case TMPFS_MAGIC:
      return "tmpfs (RAM: fsync and cache drops do nothing)";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    default:
      return absl::StrFormat("0x%x", static_cast<uint64_t>(info.f_type));
  }
}

absl::StatusOr<ScratchDir> ScratchDir::Create(const std::string& parent) {
  std::string pattern = absl::StrCat(parent, "/tessera-checkpoint-bench-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return ErrnoToStatus(errno, absl::StrCat("mkdtemp in ", parent));
  }
  return ScratchDir(std::move(pattern));
}

ScratchDir::ScratchDir(ScratchDir&& other) noexcept : path_(std::exchange(other.path_, "")) {}

ScratchDir::~ScratchDir() {
  if (path_.empty()) return;
  std::error_code error;
  std::filesystem::remove_all(path_, error);
  if (error) std::cerr << "checkpoint_bench: cannot remove " << path_ << ": " << error << "\n";
}

}  // namespace tessera::bench
