// What Linux says about a process in /proc/<pid>/stat, for the worker's bookkeeping of its
// trainers: the start time that, with the pid, names one process for good (a pid alone may be
// reused once the process is gone), and the scheduler state that tells a hung rank's cause
// (stopped, waiting on uninterruptible I/O, ...). Stateless free functions; thread-safe.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tessera::worker {

// Fields of /proc/<pid>/stat the worker uses.
struct ProcStat {
  // Field 3: R running, S sleeping, D uninterruptible wait, Z zombie, T stopped, t traced, ...
  char state = '?';
  // Field 5: process group id.
  pid_t process_group = 0;
  // Field 22: start time after boot, in clock ticks.
  uint64_t start_time = 0;
};

// NOT_FOUND when no process `pid` exists; INTERNAL when its stat line cannot be parsed.
absl::StatusOr<ProcStat> ReadProcStat(pid_t pid);

// Parses one /proc/<pid>/stat line (the command name may hold spaces and parentheses).
absl::StatusOr<ProcStat> ParseProcStat(const std::string& line);

// "stopped" for T, "uninterruptible I/O wait" for D, ...; for failure messages.
std::string DescribeProcessState(char state);

}  // namespace tessera::worker
