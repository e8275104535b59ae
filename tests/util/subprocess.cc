#include "tests/util/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tests/util/wait.h"

extern char** environ;

namespace tessera::testing {
namespace {

ExitInfo DecodeWaitStatus(int status) {
  ExitInfo info;
  if (WIFEXITED(status)) info.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) info.signal = WTERMSIG(status);
  return info;
}

// Spawns argv with stderr (and stdout when `merge_stdout`) on one new pipe,
// whose read end is returned in `read_fd`; `extra_env` entries override the
// inherited environment.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, int* read_fd, bool merge_stdout,
                            const std::vector<std::string>& extra_env = {}) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  if (merge_stdout) posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const auto& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_entries;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    std::string text = *entry;
    std::string name = text.substr(0, text.find('='));
    bool replaced = false;
    for (const auto& extra : extra_env) replaced |= extra.substr(0, extra.find('=')) == name;
    if (!replaced) env_entries.push_back(text);
  }
  env_entries.insert(env_entries.end(), extra_env.begin(), extra_env.end());
  std::vector<char*> envp;
  for (auto& entry : env_entries) envp.push_back(entry.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    return absl::NotFoundError(absl::StrCat("cannot start ", argv[0], ": ", strerror(rc)));
  }
  *read_fd = fds[0];
  return pid;
}

}  // namespace

std::string BinDir() {
  const char* dir = std::getenv("TESSERA_BIN_DIR");
  return dir != nullptr ? dir : TESSERA_DEFAULT_BIN_DIR;
}

absl::StatusOr<Subprocess> Subprocess::Start(const std::vector<std::string>& argv,
                                             const SubprocessOptions& options) {
  int fd = -1;
  auto pid = Spawn(argv, &fd, options.merge_stdout, options.extra_env);
  if (!pid.ok()) return pid.status();
  return Subprocess(*pid, fd);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(other.pid_),
      stderr_fd_(other.stderr_fd_),
      stderr_text_(std::move(other.stderr_text_)),
      scanned_(other.scanned_) {
  other.pid_ = -1;
  other.stderr_fd_ = -1;
}

Subprocess::~Subprocess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (stderr_fd_ >= 0) close(stderr_fd_);
}

void Subprocess::DrainStderr(absl::Duration wait) {
  pollfd pfd{stderr_fd_, POLLIN, 0};
  if (poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(wait))) <= 0) return;
  char buffer[4096];
  ssize_t n = read(stderr_fd_, buffer, sizeof(buffer));
  if (n > 0) {
    stderr_text_.append(buffer, static_cast<size_t>(n));
  } else if (n == 0) {
    close(stderr_fd_);
    stderr_fd_ = -1;
  }
}

absl::StatusOr<std::string> Subprocess::WaitForStderrLine(const std::string& needle,
                                                          absl::Duration timeout) {
  absl::Time deadline = absl::Now() + timeout;
  while (true) {
    // Look for the needle in complete lines not yet returned.
    size_t end;
    while ((end = stderr_text_.find('\n', scanned_)) != std::string::npos) {
      std::string line = stderr_text_.substr(scanned_, end - scanned_);
      scanned_ = end + 1;
      if (line.find(needle) != std::string::npos) return line;
    }
    if (stderr_fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("stderr closed before '", needle, "'; it said: ", stderr_text_));
    }
    absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no '", needle, "' on stderr in time; it said: ", stderr_text_));
    }
    DrainStderr(std::min(left, absl::Milliseconds(100)));
  }
}

absl::StatusOr<ExitInfo> Subprocess::Stop(int signal_number, absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("process already stopped");
  kill(pid_, signal_number);
  return Wait(timeout);
}

absl::StatusOr<ExitInfo> Subprocess::Wait(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("process already stopped");
  // With a stderr pipe, draining it (up to 20 ms) is the wait between looks.
  int status = 0;
  const bool exited = WaitUntil(
      [&] {
        if (waitpid(pid_, &status, WNOHANG) == pid_) return true;
        if (stderr_fd_ >= 0) DrainStderr(absl::Milliseconds(20));
        return false;
      },
      timeout, stderr_fd_ >= 0 ? absl::ZeroDuration() : kDefaultPoll);
  if (exited) {
    pid_ = -1;
    while (stderr_fd_ >= 0) DrainStderr(absl::Milliseconds(100));
    return DecodeWaitStatus(status);
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  return absl::DeadlineExceededError(
      absl::StrCat("process did not exit within ", absl::FormatDuration(timeout)));
}

absl::StatusOr<RunResult> RunCommand(const std::vector<std::string>& argv, absl::Duration timeout) {
  int fd = -1;
  auto pid = Spawn(argv, &fd, /*merge_stdout=*/true);
  if (!pid.ok()) return pid.status();
  RunResult result;
  absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (true) {
    int wait_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (wait_ms <= 0) {
      kill(*pid, SIGKILL);
      waitpid(*pid, nullptr, 0);
      close(fd);
      return absl::DeadlineExceededError(absl::StrCat(argv[0], " ran past its timeout"));
    }
    pollfd pfd{fd, POLLIN, 0};
    if (poll(&pfd, 1, wait_ms) <= 0) continue;
    ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n <= 0) break;
    result.output.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  int status = 0;
  waitpid(*pid, &status, 0);
  result.exit = DecodeWaitStatus(status);
  return result;
}

}  // namespace tessera::testing
