// Subprocess: starts a real binary for multi-process tests, with stdout and
// stderr captured, and stops it with a signal. Kills the process on
// destruction so a failed test leaves nothing running.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::testing {

struct ExitInfo {
  // Exit code when the process exited, -1 otherwise.
  int exit_code = -1;
  // Terminating signal when it was killed, 0 otherwise.
  int signal = 0;
};

struct SubprocessOptions {
  // Capture stdout together with stderr (stderr_text() holds both).
  bool merge_stdout = false;
  // NAME=VALUE entries added to (or replacing in) the inherited environment.
  std::vector<std::string> extra_env;
};

// Thread safety: one thread at a time.
class Subprocess {
 public:
  // Starts `argv[0]` (a path) with `argv`.
  static absl::StatusOr<Subprocess> Start(const std::vector<std::string>& argv,
                                          const SubprocessOptions& options = {});

  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  Subprocess(const Subprocess&) = delete;
  ~Subprocess();

  pid_t pid() const { return pid_; }

  // Reads stderr until a line containing `needle` arrives; returns that line.
  // DEADLINE_EXCEEDED after `timeout`, FAILED_PRECONDITION if the process
  // closes stderr first.
  absl::StatusOr<std::string> WaitForStderrLine(const std::string& needle,
                                                absl::Duration timeout = absl::Seconds(30));

  // Sends `signal_number` and waits up to `timeout` for the exit;
  // DEADLINE_EXCEEDED (after SIGKILL) if it does not go.
  absl::StatusOr<ExitInfo> Stop(int signal_number, absl::Duration timeout = absl::Seconds(30));

  // Waits up to `timeout` for the process to exit by itself, reading its
  // output meanwhile; DEADLINE_EXCEEDED (after SIGKILL) if it does not.
  absl::StatusOr<ExitInfo> Wait(absl::Duration timeout);

  // Everything read from stderr so far.
  const std::string& stderr_text() const { return stderr_text_; }

 private:
  Subprocess(pid_t pid, int stderr_fd) : pid_(pid), stderr_fd_(stderr_fd) {}
  void DrainStderr(absl::Duration wait);

  pid_t pid_;
  int stderr_fd_;
  std::string stderr_text_;
  size_t scanned_ = 0;
};

// Runs a command to completion and returns its exit and combined output.
struct RunResult {
  ExitInfo exit;
  std::string output;
};
absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv,
                                     absl::Duration timeout = absl::Seconds(60));

// Directory of the built binaries: $TESSERA_BIN_DIR, else the build's bin/.
std::string BinDir();

}  // namespace tessera::testing
