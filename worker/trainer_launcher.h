// The seam between the worker and its trainer processes: TrainerLauncher starts a rank and hands
// back a TrainerHandle, through which the worker polls, signals, stops and kills it. The real
// implementation (ProcessLauncher() in worker/trainer_process.h) spawns tessera-trainer; tests of
// the worker's supervision pass a fake that exits, ignores signals or hangs on command, so the
// agent runs in-process on a simulated clock.
//
// Thread safety: implementations may be called from any thread; a TrainerHandle's methods may
// run concurrently (Poll while another thread is in Stop).
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::worker {

// What to start and where its output goes.
struct LaunchSpec {
  // Path of tessera-trainer (or a test's fake); a name without '/' is looked up in $PATH. A
  // relative path is resolved against the worker's directory, not `working_dir`.
  std::string binary;
  // Arguments after argv[0], e.g. {"--task=/work/x/rank-0.task.pb"}.
  std::vector<std::string> args;
  // Added to (or replacing in) the worker's environment: RANK, WORLD_SIZE, CUDA_VISIBLE_DEVICES...
  std::map<std::string, std::string> env;
  // stdout and stderr are both appended here; the file and its parents are created.
  std::string log_path;
  // The child's working directory; "" inherits the worker's.
  std::string working_dir;
  // A descriptor of the worker's that the child inherits as `inherited_fd_number` (every other
  // descriptor past stderr is closed in the child); -1: none. The worker keeps its own copy.
  int inherited_fd = -1;
  int inherited_fd_number = 3;
};

// How a process ended.
struct ExitStatus {
  // The exit code when the process exited, -1 when a signal killed it.
  int exit_code = -1;
  // The signal that killed it, 0 when it exited.
  int signal = 0;
};

// One launched trainer rank, from launch to reaping.
class TrainerHandle {
 public:
  virtual ~TrainerHandle() = default;

  // The process id (also its process group's); what the worker's pid files record.
  virtual pid_t pid() const = 0;
  // Non-blocking: the exit status once the process has exited; else nullopt.
  virtual std::optional<ExitStatus> Poll() = 0;
  // SIGTERM, then SIGKILL after `grace` if still alive; returns the exit status. Idempotent.
  virtual ExitStatus Stop(absl::Duration grace) = 0;
  // Sends `signal` to the trainer; a no-op once it has exited.
  virtual void Signal(int signal) = 0;
  // SIGKILL at once (a hung rank may never act on a SIGTERM); idempotent like Stop.
  virtual ExitStatus Kill() = 0;
  // The last `lines` lines of the rank's log, for failure messages; "" when unreadable.
  virtual std::string LogTail(int lines) const = 0;
};

class TrainerLauncher {
 public:
  virtual ~TrainerLauncher() = default;

  // Starts one rank. NOT_FOUND naming the binary when it cannot be started; see
  // TrainerProcess::Launch for the real launcher's other errors.
  virtual absl::StatusOr<std::unique_ptr<TrainerHandle>> Launch(const LaunchSpec& spec) = 0;
};

}  // namespace tessera::worker
