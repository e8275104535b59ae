// TrainerProcess: launches one trainer rank as a child process of the worker, supervises it and
// stops it. The child runs in a process group of its own, so stopping it also stops whatever it
// spawned (data-loader workers, compilers); once the child has exited, by itself or by Stop, the
// rest of its group is killed too, so a trainer never leaves an orphan behind. Its stdout and
// stderr are appended to one log file, which LogTail and LogReader read. It is the real
// TrainerHandle behind the worker's TrainerLauncher seam (worker/trainer_launcher.h).
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "worker/trainer_launcher.h"

namespace tessera::worker {

// How long, after the group leader has gone, Poll/Stop/the destructor wait for the rest of its
// group (already sent SIGKILL) to disappear.
inline constexpr absl::Duration kGroupDrainTimeout = absl::Seconds(2);

// Most bytes LogTail returns, whatever `lines` says (the end is kept).
inline constexpr size_t kMaxLogTailBytes = 64 * 1024;

// One trainer process, from launch to reaping. Destruction of a process still running kills its
// group with SIGKILL and reaps it. Thread-safe: the exit status is guarded by `mu_`, which is never
// held while Stop waits out the grace period, so Poll stays non-blocking during a Stop.
class TrainerProcess final : public TrainerHandle {
 public:
  // Starts `spec.binary`. NOT_FOUND naming the binary (or the working directory) when it cannot
  // be started; INVALID_ARGUMENT for an empty binary or a malformed environment name; the errno
  // status when the log file cannot be opened.
  static absl::StatusOr<std::unique_ptr<TrainerProcess>> Launch(const LaunchSpec& spec);

  TrainerProcess(const TrainerProcess&) = delete;
  TrainerProcess& operator=(const TrainerProcess&) = delete;
  ~TrainerProcess() override;

  // The child's pid, which is also its process-group id.
  pid_t pid() const override { return pid_; }
  const std::string& log_path() const { return log_path_; }

  // Non-blocking (but for draining a killed group, see kGroupDrainTimeout): the exit status once
  // the process has exited, reaping it and killing what is left of its group; else nullopt.
  std::optional<ExitStatus> Poll() override;

  // SIGTERM to the group, then SIGKILL to the group after `grace` if the child is still alive;
  // returns the exit status. Idempotent: later calls (and calls after Poll saw the exit) return the
  // same status without signalling anything.
  ExitStatus Stop(absl::Duration grace) override;

  // Sends `signal` to the trainer process alone (not its group: helpers it started keep their
  // default dispositions); a no-op once it has exited.
  void Signal(int signal) override;

  // SIGKILL to the group at once, then reaps; for a hung rank, which a SIGTERM may never reach (a
  // stopped process only queues it). Idempotent like Stop.
  ExitStatus Kill() override;

  // The last `lines` lines of the log (at most kMaxLogTailBytes), for failure messages; "" when
  // the log cannot be read.
  std::string LogTail(int lines) const override;

 private:
  TrainerProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  // Whether the child has exited, without reaping it (its zombie keeps the group id reserved).
  bool ChildExited() const;
  // SIGKILLs the group, reaps the child and records its status; then waits for the rest of the
  // group to go, reaping those members this process adopted as a subreaper.
  ExitStatus KillGroupAndReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const pid_t pid_;
  const std::string log_path_;
  mutable absl::Mutex mu_;
  std::optional<ExitStatus> exit_status_ ABSL_GUARDED_BY(mu_);
};

// The launcher that starts TrainerProcesses; lives forever.
TrainerLauncher* ProcessLauncher();

// Makes the calling process a child subreaper (Linux PR_SET_CHILD_SUBREAPER), so that descendants
// orphaned by a trainer's exit are re-parented to it rather than to init, and TrainerProcess reaps
// them when it drains the trainer's group. The worker daemon calls it once at start; without it,
// killed grandchildren linger as zombies until init reaps them (some container inits never do).
absl::Status BecomeChildSubreaper();

// Writes `message` to `path` atomically (a temporary file beside it, then rename), creating the
// parent directories; for task files read by the trainer.
absl::Status WriteMessageFile(const std::string& path, const google::protobuf::Message& message);

}  // namespace tessera::worker
