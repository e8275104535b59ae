// The parts of checkpoint_bench that need no LibTorch: timing of phased
// operations, the plain baseline (a sequential write and read of the same
// bytes, as dd does), page-cache control for cold reads, and the scratch
// directory both sides write into.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::bench {

// Block size of the plain side's write() and read() calls, as dd bs=8M.
inline constexpr size_t kPlainBlockBytes = size_t{8} << 20;

// Wall seconds spent in each named phase of one timed operation, in order,
// and the CPU seconds of the whole operation (user + system, this process,
// all threads). On a busy machine wall time grows past CPU time; CPU time
// says what the operation itself costs.
struct PhaseTimes {
  std::vector<std::pair<std::string, double>> phases;
  double cpu_seconds = 0;

  double Total() const;
};

// Times consecutive phases of one operation: each Lap() closes the phase that
// began at the previous Lap() (or at construction). One thread at a time.
class PhaseClock {
 public:
  PhaseClock();
  void Lap(std::string phase);
  PhaseTimes Take() &&;

 private:
  std::chrono::steady_clock::time_point last_;
  double cpu_start_;
  PhaseTimes times_;
};

// dd bs=8M conv=fsync, plus an fsync of the file's directory (the
// checkpoint commit fsyncs the directories it changes, too): a new file at
// `path` holding `bytes`, durable on return. Phases: write, fsync.
absl::StatusOr<PhaseTimes> WritePlain(const std::string& path, const std::string& bytes);

// dd bs=8M reading the file at `path` into `*buffer`, which the caller sized
// to the file and touched, so that no page faults are timed. DATA_LOSS when
// the file is shorter. Phase: read.
absl::StatusOr<PhaseTimes> ReadPlain(const std::string& path, std::string* buffer);

// fdatasyncs and then drops (POSIX_FADV_DONTNEED) every regular file under
// `dir` from the page cache; returns the largest fraction of any of them still
// resident afterwards (mincore), 0 when the drop worked.
absl::StatusOr<double> DropTreeFromPageCache(const std::string& dir);

// Commits the file system's journal (syncfs), and with it the work that
// deleting files left behind: block frees, and discards on a file system
// mounted with -o discard. Called after deletions so that work is not charged
// to the next timed operation.
absl::Status SettleFileSystem(const std::string& dir);

// Faults in `bytes` of fresh anonymous memory and gives it back, so that the
// next allocations of up to that much reuse pages the kernel has just had in
// use. On a VM whose balloon reports free pages to the host (virtio-balloon
// free page reporting), pages free for more than about two seconds go back to
// the host and cost about a second per GB of host faults when used again;
// called right before each timed operation, outside the clock, this gives
// every operation the same warm memory whatever ran before it.
absl::Status PrefaultFreeMemory(size_t bytes);

// "ext2/3/4", "xfs", "tmpfs (...)", ... or the statfs magic number in hex.
std::string FileSystemType(const std::string& path);

// A fresh directory under `parent`, removed with everything in it when this
// goes out of scope, on success and on every error path.
class ScratchDir {
 public:
  static absl::StatusOr<ScratchDir> Create(const std::string& parent);
  ScratchDir(ScratchDir&& other) noexcept;
  ScratchDir& operator=(ScratchDir&&) = delete;
  ~ScratchDir();

  const std::string& path() const { return path_; }

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace tessera::bench
