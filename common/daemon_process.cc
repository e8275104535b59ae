#include "common/daemon_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/read_file.h"

extern char** environ;

namespace tessera {
namespace {

std::string LogOrNote(const std::string& path) {
  auto log = ReadWholeFile(path);
  return log.ok() ? *log : absl::StrCat("(no log: ", log.status().message(), ")");
}

}  // namespace

absl::StatusOr<ServingDaemon> StartDaemon(const std::vector<std::string>& argv,
                                          const std::string& log_path, absl::Duration timeout) {
  if (argv.empty()) return absl::InvalidArgumentError("StartDaemon: empty argv");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<std::string> storage = argv;
  std::vector<char*> args;
  for (auto& arg : storage) args.push_back(arg.data());
  args.push_back(nullptr);
  ServingDaemon daemon;
  const int rc = posix_spawn(&daemon.pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  static const std::regex kServing(R"(serving gRPC on (\S+:\d+)(, metrics on port (\d+))?)");
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto log = ReadWholeFile(log_path);
    std::smatch match;
    if (log.ok() && std::regex_search(*log, match, kServing)) {
      daemon.address = match[1];
      if (match[3].matched) daemon.metrics_port = std::stoi(match[3]);
      return daemon;
    }
    if (waitpid(daemon.pid, nullptr, WNOHANG) == daemon.pid) {
      return absl::UnavailableError(
          absl::StrCat(argv[0], " exited before serving: ", LogOrNote(log_path)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  StopDaemon(daemon.pid, absl::Seconds(5));
  return absl::UnavailableError(absl::StrCat(
      argv[0], " did not serve within ", absl::FormatDuration(timeout), ": ", LogOrNote(log_path)));
}

bool StopDaemon(pid_t pid, absl::Duration timeout) {
  if (pid <= 0) return true;
  kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return false;
}

}  // namespace tessera
