// Trainers that outlive a worker: the worker records each trainer it launches in a pid file
// (<work_dir>/trainers/<pid>.pid: task id, rank, and the process start time, so that a recycled
// pid is never mistaken for the trainer), removes the file once it has reaped the process, and at
// start kills whatever trainers a predecessor (a crashed or SIGKILLed worker) left running
// before it registers. This is the backstop for trainers the kernel's parent-death signal and the
// closed report socket did not already end (see common/trainer_env.h, trainer/report/reporter.h).
//
// Thread safety: free functions over files that each name one pid; concurrent calls for
// different pids are safe, and the worker calls KillOrphanedTrainers before it starts launching.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::worker {

// How long KillOrphanedTrainers waits, after SIGKILL, for the orphans to disappear.
inline constexpr absl::Duration kOrphanKillTimeout = absl::Seconds(2);

// One launched trainer, as its pid file records it.
struct TrainerRecord {
  pid_t pid = 0;
  std::string task_id;
  int rank = -1;
  // /proc/<pid>/stat field 22 when the trainer was launched.
  uint64_t start_time = 0;
};

// <dir>/<pid>.pid.
std::string PidFilePath(const std::string& dir, pid_t pid);

// Writes the pid file of a running trainer `pid` (its start time read from /proc), creating `dir`.
// NOT_FOUND when the process is already gone.
absl::Status RecordTrainer(const std::string& dir, pid_t pid, const std::string& task_id, int rank);

// Writes `record` as <dir>/<record.pid>.pid (atomically: a temporary file, then rename).
absl::Status WritePidFile(const std::string& dir, const TrainerRecord& record);

// Removes <dir>/<pid>.pid; OK when it does not exist.
absl::Status RemovePidFile(const std::string& dir, pid_t pid);

// Reads one pid file. INVALID_ARGUMENT naming the file when it is malformed.
absl::StatusOr<TrainerRecord> ReadPidFile(const std::string& path);

struct OrphanSweep {
  // Live trainers that matched their record and were sent SIGKILL (to their whole group).
  std::vector<TrainerRecord> killed;
  // Of those, the ones still alive when the timeout ran out.
  std::vector<TrainerRecord> survived;
  // Records whose process had already gone, or whose pid now names another process.
  std::vector<TrainerRecord> stale;
  // Files that could not be read or parsed (removed too), with why.
  std::vector<std::string> unreadable;
};

// For every pid file in `dir`: when the pid still names the recorded process (same start time),
// SIGKILLs its process group (the trainer leads its own); then waits up to `timeout` for the
// killed trainers to be gone (or zombies) and removes every pid file but the survivors'. An absent
// `dir` is an empty sweep.
absl::StatusOr<OrphanSweep> KillOrphanedTrainers(const std::string& dir,
                                                 absl::Duration timeout = kOrphanKillTimeout);

}  // namespace tessera::worker
