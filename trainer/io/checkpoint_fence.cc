#include "trainer/io/checkpoint_fence.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/errno_status.h"
#include "common/read_file.h"
#include "common/scoped_fd.h"
#include "common/status_macros.h"

namespace tessera::trainer {
namespace {

// Polling interval of a lock wait: flock has no timed form, and a wait only happens while another
// attempt's rank 0 commits (milliseconds), so a short poll costs nothing measurable.
constexpr std::chrono::milliseconds kLockPoll{5};

std::string JoinPath(const std::string& dir, absl::string_view name) {
  if (dir.empty() || dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

absl::Status MakeRoot(const std::string& root) {
  std::error_code error;
  std::filesystem::create_directories(root, error);
  if (error) return ErrnoToStatus(error.value(), absl::StrCat("mkdir ", root));
  return absl::OkStatus();
}

absl::Status FsyncDirectory(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, path);
  if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(path, ": fsync"));
  return absl::OkStatus();
}

// The record: "attempt <n>\njob <id>\n". The job id is the rest of its line, so any id that has
// no newline round-trips.
std::string FormatFence(const std::string& job_id, int64_t attempt) {
  return absl::StrCat("attempt ", attempt, "\njob ", job_id, "\n");
}

absl::Status WriteFenceFile(const std::string& root, const std::string& job_id, int64_t attempt) {
  const std::string path = JoinPath(root, kFenceFileName);
  const std::string temporary = absl::StrCat(path, ".tmp");
  const std::string contents = FormatFence(job_id, attempt);
  {
    ScopedFd fd(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return ErrnoToStatus(errno, temporary);
    size_t written = 0;
    while (written < contents.size()) {
      const ssize_t n = ::write(fd.get(), contents.data() + written, contents.size() - written);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoToStatus(errno, absl::StrCat(temporary, ": write"));
      }
      written += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0) return ErrnoToStatus(errno, absl::StrCat(temporary, ": fsync"));
    if (!fd.Close()) return ErrnoToStatus(errno, absl::StrCat(temporary, ": close"));
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("rename ", temporary, " to ", path));
  }
  return FsyncDirectory(root);
}

std::string Describe(const std::string& job_id, int64_t attempt) {
  return absl::StrCat("attempt ", attempt, " of job ", job_id.empty() ? "(unnamed)" : job_id);
}

}  // namespace

absl::StatusOr<FenceLock> FenceLock::Acquire(const std::string& root,
                                             std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(MakeRoot(root));
  // The directory itself is locked: no lock file appears among the checkpoints.
  const std::string& path = root;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, path);
  FenceLock lock(fd);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) return ErrnoToStatus(errno, absl::StrCat(path, ": flock"));
    if (std::chrono::steady_clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          path, ": still locked after ", timeout.count(),
          " ms (another attempt's rank 0 holds it while it commits; a frozen process keeps it)"));
    }
    std::this_thread::sleep_for(kLockPoll);
  }
  return lock;
}

FenceLock::FenceLock(FenceLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

FenceLock& FenceLock::operator=(FenceLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

// Closing the last descriptor of the open file description releases the flock.
FenceLock::~FenceLock() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<CheckpointFence> ReadCheckpointFence(const std::string& root) {
  const std::string path = JoinPath(root, kFenceFileName);
  absl::StatusOr<std::string> read = ReadWholeFile(path);
  if (!read.ok()) {
    if (absl::IsNotFound(read.status())) return CheckpointFence{};
    return read.status();
  }
  const std::string& contents = *read;
  CheckpointFence fence;
  fence.present = true;
  bool has_attempt = false;
  bool has_job = false;
  for (absl::string_view line : absl::StrSplit(contents, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "attempt ")) {
      has_attempt = absl::SimpleAtoi(line, &fence.attempt) && fence.attempt >= 0;
    } else if (absl::ConsumePrefix(&line, "job ")) {
      fence.job_id = std::string(line);
      has_job = true;
    }
  }
  if (!has_attempt || !has_job) {
    return absl::DataLossError(absl::StrCat(
        path, ": cannot parse the fence (want \"attempt <n>\" and \"job <id>\" lines); remove it "
              "only when no older attempt of the job can still be running"));
  }
  return fence;
}

absl::Status CheckCheckpointFenceLocked(const std::string& root, const std::string& job_id,
                                        int64_t attempt) {
  ASSIGN_OR_RETURN(CheckpointFence fence, ReadCheckpointFence(root));
  if (!fence.present) return absl::OkStatus();
  if (fence.job_id == job_id && fence.attempt <= attempt) return absl::OkStatus();
  const std::string why = fence.job_id == job_id
                              ? "a newer attempt of the job has started; this one is stale"
                              : "another job has taken the checkpoint directory over";
  return absl::FailedPreconditionError(
      absl::StrCat("checkpoint write refused: ", Describe(job_id, attempt), " is fenced off by ",
                   Describe(fence.job_id, fence.attempt), " in ", JoinPath(root, kFenceFileName),
                   " (", why, ")"));
}

absl::Status CheckCheckpointFence(const std::string& root, const std::string& job_id,
                                  int64_t attempt) {
  ASSIGN_OR_RETURN(FenceLock lock, FenceLock::Acquire(root));
  return CheckCheckpointFenceLocked(root, job_id, attempt);
}

absl::Status RaiseCheckpointFence(const std::string& root, const std::string& job_id,
                                  int64_t attempt, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(FenceLock lock, FenceLock::Acquire(root, timeout));
  return RaiseCheckpointFenceLocked(root, job_id, attempt);
}

absl::Status RaiseCheckpointFenceLocked(const std::string& root, const std::string& job_id,
                                        int64_t attempt) {
  if (attempt < 0) {
    return absl::InvalidArgumentError(absl::StrCat("fence attempt ", attempt, " is negative"));
  }
  ASSIGN_OR_RETURN(CheckpointFence fence, ReadCheckpointFence(root));
  if (fence.present && fence.job_id == job_id) {
    if (fence.attempt > attempt) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot start ", Describe(job_id, attempt), ": it is fenced off by ",
          Describe(fence.job_id, fence.attempt), " in ", JoinPath(root, kFenceFileName),
          " (a newer attempt of the job has started; this one is stale)"));
    }
    if (fence.attempt == attempt) return absl::OkStatus();
  }
  return WriteFenceFile(root, job_id, attempt);
}

}  // namespace tessera::trainer
