// The fence of a job's checkpoint directory: <root>/FENCE records the job and the highest attempt
// that has started writing there, so that a stale attempt (a rank 0 that was frozen, partitioned
// away or slow while the coordinator restarted the job) can never commit a checkpoint over a newer
// attempt's. The check rests on the directory itself, not on the coordinator's word: a new
// attempt's rank 0 raises the fence before it loads anything (RaiseCheckpointFence), and
// CommitCheckpoint checks it and renames the staging directory into place while holding an
// exclusive advisory lock (flock) on the <root> directory, the same lock the raise takes, so that a
// commit never slips between a newer attempt's raise and its load. A directory without FENCE
// (written before fences existed) counts as attempt 0 of any job. A fence of another job is
// replaced by the next attempt that starts: the directory then belongs to that job and the other
// job's attempts are fenced off. Thread-safe and process-safe: every caller takes the lock on its
// own open file description. No LibTorch here.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tessera::trainer {

// The fence's file inside the checkpoint root.
inline constexpr char kFenceFileName[] = "FENCE";

// How long the fence's lock is waited for before DEADLINE_EXCEEDED. The lock is held only for a
// check, a rename, an fsync and retention, so a long wait means its holder is frozen (SIGSTOP) in
// there; the wait is bounded so that the attempt fails with a cause instead of hanging.
inline constexpr std::chrono::milliseconds kDefaultFenceLockTimeout{std::chrono::minutes(2)};

// Who holds a checkpoint directory: the job and its highest attempt that has started.
struct CheckpointFence {
  std::string job_id;
  int64_t attempt = 0;
  // False when <root>/FENCE does not exist (every attempt may commit).
  bool present = false;
};

// An exclusive flock on the directory <root> (flock, not fcntl: it excludes threads of one process
// too, each holding its own open file description; local file systems and NFSv4), released on destruction (or when the process dies, so
// a killed holder never leaves the directory locked). Movable, not copyable.
class FenceLock {
 public:
  // Creates `root` if needed and waits up to `timeout` for the lock: DEADLINE_EXCEEDED naming
  // `root` when it stays held; the open's error otherwise.
  static absl::StatusOr<FenceLock> Acquire(
      const std::string& root, std::chrono::milliseconds timeout = kDefaultFenceLockTimeout);

  FenceLock(FenceLock&& other) noexcept;
  FenceLock& operator=(FenceLock&& other) noexcept;
  FenceLock(const FenceLock&) = delete;
  FenceLock& operator=(const FenceLock&) = delete;
  ~FenceLock();

 private:
  explicit FenceLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Reads <root>/FENCE; present = false when it (or `root`) does not exist. DATA_LOSS naming the
// file when it cannot be parsed. Takes no lock: a caller that acts on the answer holds FenceLock.
absl::StatusOr<CheckpointFence> ReadCheckpointFence(const std::string& root);

// With the lock held: OK when `attempt` of `job_id` may write into `root`, i.e. the fence is
// absent, or is of the same job at an attempt <= `attempt`. FAILED_PRECONDITION otherwise, e.g.
// "checkpoint commit refused: attempt 2 of job j is fenced off by attempt 3 in <root>/FENCE (a newer
// attempt of the job has started; this one is stale)".
absl::Status CheckCheckpointFenceLocked(const std::string& root, const std::string& job_id,
                                        int64_t attempt);

// Takes the lock and checks as above: for a stale attempt to stop before it writes (a save's
// staging directory) rather than only at the commit.
absl::Status CheckCheckpointFence(const std::string& root, const std::string& job_id,
                                  int64_t attempt);

// RaiseCheckpointFence with the lock already held by the caller.
absl::Status RaiseCheckpointFenceLocked(const std::string& root, const std::string& job_id,
                                        int64_t attempt);

// A new attempt's rank 0, before it loads a checkpoint: under the lock, writes FENCE = (job_id,
// attempt) atomically (a temporary file, fsync, rename, fsync of `root`), creating `root` if
// needed. FAILED_PRECONDITION when the fence already holds a higher attempt of the same job (this
// attempt is itself stale); a fence of another job is replaced. Raising to the same attempt again
// is OK (a restarted rank 0 of one attempt never happens, but costs nothing).
absl::Status RaiseCheckpointFence(const std::string& root, const std::string& job_id,
                                  int64_t attempt,
                                  std::chrono::milliseconds timeout = kDefaultFenceLockTimeout);

}  // namespace tessera::trainer
