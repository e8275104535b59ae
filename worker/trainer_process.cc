#include "worker/trainer_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errno_status.h"
#include "common/scoped_fd.h"
#include "worker/log_reader.h"

extern char** environ;

namespace tessera::worker {
namespace {

// How often Stop and the group drain look at a process that has been signalled.
constexpr absl::Duration kPollInterval = absl::Milliseconds(5);

// posix_spawn's attribute and file-action objects, destroyed on every path.
struct SpawnObjects {
  SpawnObjects() {
    posix_spawnattr_init(&attributes);
    posix_spawn_file_actions_init(&actions);
  }
  ~SpawnObjects() {
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attributes);
  }
  SpawnObjects(const SpawnObjects&) = delete;
  SpawnObjects& operator=(const SpawnObjects&) = delete;

  posix_spawnattr_t attributes;
  posix_spawn_file_actions_t actions;
};

// The worker's environment with `overrides` added or replacing entries of the same name.
absl::StatusOr<std::vector<std::string>> ChildEnvironment(
    const std::map<std::string, std::string>& overrides) {
  for (const auto& [name, value] : overrides) {
    if (name.empty() || name.find('=') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("environment variable name \"", name, "\" is empty or contains '='"));
    }
  }
  std::vector<std::string> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    const size_t equals = text.find('=');
    if (equals != std::string_view::npos &&
        overrides.contains(std::string(text.substr(0, equals)))) {
      continue;
    }
    entries.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) entries.push_back(absl::StrCat(name, "=", value));
  return entries;
}

std::vector<char*> CStringArray(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  pointers.reserve(strings.size() + 1);
  for (std::string& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

ExitStatus DecodeWaitStatus(int status) {
  ExitStatus exit;
  if (WIFEXITED(status)) {
    exit.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    exit.signal = WTERMSIG(status);
  }
  return exit;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainerProcess>> TrainerProcess::Launch(const LaunchSpec& spec) {
  if (spec.binary.empty()) return absl::InvalidArgumentError("trainer binary is empty");
  if (spec.log_path.empty()) return absl::InvalidArgumentError("trainer log_path is empty");
  if (spec.inherited_fd >= 0 && spec.inherited_fd_number <= STDERR_FILENO) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trainer inherited descriptor number ", spec.inherited_fd_number, " is not past stderr"));
  }
  const bool search_path = spec.binary.find('/') == std::string::npos;
  std::string binary = spec.binary;
  std::error_code error;
  if (!search_path) {
    // Resolved here: the child changes directory before exec.
    binary = std::filesystem::absolute(spec.binary, error).string();
    if (error) binary = spec.binary;
    if (access(binary.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot execute trainer binary ", spec.binary, ": ",
                                              std::generic_category().message(errno)));
    }
  }
  if (!spec.working_dir.empty() && !std::filesystem::is_directory(spec.working_dir, error)) {
    return absl::NotFoundError(
        absl::StrCat("trainer working directory ", spec.working_dir, " is not a directory"));
  }
  std::filesystem::path log_path(spec.log_path);
  if (log_path.has_parent_path()) {
    std::filesystem::create_directories(log_path.parent_path(), error);
    if (error) {
      return ErrnoToStatus(error.value(),
                           absl::StrCat("creating the directory of log ", spec.log_path));
    }
  }
  const int log_fd = open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return ErrnoToStatus(errno, absl::StrCat("opening log ", spec.log_path));
  ScopedFd log_closer(log_fd);

  absl::StatusOr<std::vector<std::string>> env = ChildEnvironment(spec.env);
  if (!env.ok()) return env.status();
  std::vector<std::string> argv = {spec.binary};
  argv.insert(argv.end(), spec.args.begin(), spec.args.end());
  std::vector<char*> argv_pointers = CStringArray(argv);
  std::vector<char*> env_pointers = CStringArray(*env);

  SpawnObjects spawn;
  // Its own group, so that signals to -pid reach everything it starts. Default dispositions and
  // an empty mask: the daemon blocks SIGTERM/SIGINT for its shutdown thread, and a child would
  // otherwise inherit that and ignore Stop's SIGTERM.
  sigset_t all_signals;
  sigset_t no_signals;
  sigfillset(&all_signals);
  sigemptyset(&no_signals);
  posix_spawnattr_setflags(&spawn.attributes,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  posix_spawnattr_setpgroup(&spawn.attributes, 0);
  posix_spawnattr_setsigdefault(&spawn.attributes, &all_signals);
  posix_spawnattr_setsigmask(&spawn.attributes, &no_signals);
  posix_spawn_file_actions_addopen(&spawn.actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&spawn.actions, log_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&spawn.actions, log_fd, STDERR_FILENO);
  int first_closed = STDERR_FILENO + 1;
  if (spec.inherited_fd >= 0) {
    // dup2 clears the copy's close-on-exec flag.
    posix_spawn_file_actions_adddup2(&spawn.actions, spec.inherited_fd, spec.inherited_fd_number);
    first_closed = spec.inherited_fd_number + 1;
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
  // The daemon's sockets and files are no business of the trainer, CLOEXEC or not.
  posix_spawn_file_actions_addclosefrom_np(&spawn.actions, first_closed);
#endif
  if (!spec.working_dir.empty()) {
    posix_spawn_file_actions_addchdir_np(&spawn.actions, spec.working_dir.c_str());
  }

  pid_t pid = -1;
  const int spawn_error =
      search_path ? posix_spawnp(&pid, binary.c_str(), &spawn.actions, &spawn.attributes,
                                 argv_pointers.data(), env_pointers.data())
                  : posix_spawn(&pid, binary.c_str(), &spawn.actions, &spawn.attributes,
                                argv_pointers.data(), env_pointers.data());
  if (spawn_error != 0) {
    if (spawn_error == ENOENT || spawn_error == EACCES || spawn_error == ENOEXEC ||
        spawn_error == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat("cannot start trainer binary ", spec.binary, ": ",
                                              std::generic_category().message(spawn_error)));
    }
    return ErrnoToStatus(spawn_error, absl::StrCat("starting trainer binary ", spec.binary));
  }
  return std::unique_ptr<TrainerProcess>(new TrainerProcess(pid, spec.log_path));
}

TrainerProcess::~TrainerProcess() {
  absl::MutexLock lock(&mu_);
  if (!exit_status_.has_value()) KillGroupAndReapLocked();
}

bool TrainerProcess::ChildExited() const {
  siginfo_t info{};
  while (waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0) {
    // ECHILD cannot happen while the child is unreaped; treat anything but EINTR as gone.
    if (errno != EINTR) return true;
  }
  return info.si_pid == pid_;
}

ExitStatus TrainerProcess::KillGroupAndReapLocked() {
  // The child is not reaped yet, so its pid still names this group and no other.
  kill(-pid_, SIGKILL);
  int status = 0;
  pid_t reaped;
  do {
    reaped = waitpid(pid_, &status, 0);
  } while (reaped < 0 && errno == EINTR);
  exit_status_ = reaped == pid_ ? DecodeWaitStatus(status) : ExitStatus{};

  // Members that outlive the leader die of the SIGKILL above; wait until none is left, reaping
  // those re-parented to this process (see BecomeChildSubreaper).
  const absl::Time deadline = absl::Now() + kGroupDrainTimeout;
  while (true) {
    while (waitpid(-pid_, nullptr, WNOHANG) > 0) {
    }
    if (kill(-pid_, 0) != 0 && errno == ESRCH) break;
    if (absl::Now() >= deadline) break;
    absl::SleepFor(kPollInterval);
  }
  return *exit_status_;
}

std::optional<ExitStatus> TrainerProcess::Poll() {
  absl::MutexLock lock(&mu_);
  if (exit_status_.has_value()) return exit_status_;
  if (!ChildExited()) return std::nullopt;
  return KillGroupAndReapLocked();
}

ExitStatus TrainerProcess::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (exit_status_.has_value()) return *exit_status_;
    kill(-pid_, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + grace;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (exit_status_.has_value()) return *exit_status_;  // Reaped by a concurrent Poll.
      if (ChildExited() || absl::Now() >= deadline) return KillGroupAndReapLocked();
    }
    absl::SleepFor(std::min(kPollInterval, std::max(deadline - absl::Now(), absl::ZeroDuration())));
  }
}

void TrainerProcess::Signal(int signal) {
  absl::MutexLock lock(&mu_);
  // While the child is not reaped its pid cannot be reused: the signal reaches the trainer.
  if (!exit_status_.has_value()) kill(pid_, signal);
}

ExitStatus TrainerProcess::Kill() {
  absl::MutexLock lock(&mu_);
  if (exit_status_.has_value()) return *exit_status_;
  return KillGroupAndReapLocked();
}

std::string TrainerProcess::LogTail(int lines) const {
  absl::StatusOr<LogReader> reader = LogReader::Open(log_path_, lines);
  if (!reader.ok()) return "";
  std::string tail;
  while (true) {
    absl::StatusOr<std::string> chunk = reader->ReadMore(kMaxLogTailBytes);
    if (!chunk.ok() || chunk->empty()) break;
    tail += *chunk;
    if (tail.size() > kMaxLogTailBytes) tail.erase(0, tail.size() - kMaxLogTailBytes);
  }
  return tail;
}

TrainerLauncher* ProcessLauncher() {
  class Launcher final : public TrainerLauncher {
   public:
    absl::StatusOr<std::unique_ptr<TrainerHandle>> Launch(const LaunchSpec& spec) override {
      absl::StatusOr<std::unique_ptr<TrainerProcess>> process = TrainerProcess::Launch(spec);
      if (!process.ok()) return process.status();
      return std::unique_ptr<TrainerHandle>(std::move(*process));
    }
  };
  static TrainerLauncher* const launcher = new Launcher();
  return launcher;
}

absl::Status BecomeChildSubreaper() {
  if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0) {
    return ErrnoToStatus(errno, "prctl(PR_SET_CHILD_SUBREAPER)");
  }
  return absl::OkStatus();
}

absl::Status WriteMessageFile(const std::string& path, const google::protobuf::Message& message) {
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot serialize ", message.GetTypeName(), " for ", path));
  }
  std::filesystem::path target(path);
  std::error_code error;
  if (target.has_parent_path()) {
    std::filesystem::create_directories(target.parent_path(), error);
    if (error)
      return ErrnoToStatus(error.value(), absl::StrCat("creating the directory of ", path));
  }
  // Unique per call, so concurrent writers of one path never share a temporary file.
  static std::atomic<uint64_t> next_temporary{0};
  const std::string temporary = absl::StrCat(path, ".tmp.", getpid(), ".", next_temporary++);
  const int fd = open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("creating ", temporary));
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int write_error = errno;
      close(fd);
      unlink(temporary.c_str());
      return ErrnoToStatus(write_error, absl::StrCat("writing ", temporary));
    }
    written += static_cast<size_t>(n);
  }
  const int sync_error = fsync(fd) != 0 ? errno : 0;
  const int close_error = close(fd) != 0 ? errno : 0;
  if (sync_error != 0 || close_error != 0) {
    unlink(temporary.c_str());
    return ErrnoToStatus(sync_error != 0 ? sync_error : close_error,
                         absl::StrCat("flushing ", temporary));
  }
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    const int rename_error = errno;
    unlink(temporary.c_str());
    return ErrnoToStatus(rename_error, absl::StrCat("renaming ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace tessera::worker
