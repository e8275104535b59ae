#include "bench/control_plane_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <regex>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/read_file.h"

extern char** environ;

namespace tessera::bench {
namespace {

// /proc files and logs are small; one page per read is plenty.
constexpr size_t kReadChunkBytes = 4096;

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::string text;
  absl::Status status = ReadFileChunks(
      path, kReadChunkBytes, [&](const char* data, size_t size) { text.append(data, size); });
  if (!status.ok()) return status;
  return text;
}

// The log, or a note that it could not be read, for error messages.
std::string LogOrNote(const std::string& path) {
  auto log = ReadWholeFile(path);
  return log.ok() ? *log : absl::StrCat("(no log: ", log.status().message(), ")");
}

// "VmRSS:    1234 kB" -> 1234 * 1024, for the line starting with `key`.
int64_t StatusFieldBytes(const std::string& status, absl::string_view key) {
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, key)) continue;
    std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    int64_t value = 0;
    if (words.empty() || !absl::SimpleAtoi(words[0], &value)) return 0;
    return words.size() > 1 && words[1] == "kB" ? value * 1024 : value;
  }
  return 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorProcess>> CoordinatorProcess::Start(
    const CoordinatorProcessOptions& options) {
  const std::string log_path = absl::StrCat(options.dir, "/coordinator.log");
  std::vector<std::string> argv = {
      options.binary,
      "--listen=127.0.0.1:0",
      "--metrics_listen=127.0.0.1:0",
      absl::StrCat("--state=", options.dir, "/state.db"),
      absl::StrCat("--checkpoint_root=", options.dir, "/checkpoints"),
      absl::StrCat("--heartbeat_timeout=", absl::FormatDuration(options.heartbeat_timeout))};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  // Its own process group: a Ctrl-C on the benchmark reaches us, and our
  // destructor stops the coordinator.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (auto& arg : argv) args.push_back(arg.data());
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot start ", options.binary, ": ", strerror(rc)));
  }
  std::unique_ptr<CoordinatorProcess> process(new CoordinatorProcess(pid, log_path));

  static const std::regex kServing(R"(serving gRPC on (\S+:\d+), metrics on port (\d+))");
  const absl::Time deadline = absl::Now() + kCoordinatorStartTimeout;
  while (absl::Now() < deadline) {
    auto log = ReadWholeFile(log_path);
    std::smatch match;
    if (log.ok() && std::regex_search(*log, match, kServing)) {
      process->address_ = match[1];
      process->metrics_port_ = std::stoi(match[2]);
      return process;
    }
    if (waitpid(pid, nullptr, WNOHANG) == pid) {
      process->pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat(options.binary, " exited before serving: ", LogOrNote(log_path)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::UnavailableError(absl::StrCat(options.binary, " did not serve within ",
                                             absl::FormatDuration(kCoordinatorStartTimeout), ": ",
                                             LogOrNote(log_path)));
}

CoordinatorProcess::~CoordinatorProcess() { (void)Stop(); }

absl::Status CoordinatorProcess::Stop() {
  if (pid_ <= 0) return absl::OkStatus();
  const pid_t pid = std::exchange(pid_, -1);
  kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + kCoordinatorStopTimeout;
  while (absl::Now() < deadline) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return absl::DeadlineExceededError(
      absl::StrCat("the coordinator (pid ", pid, ") ignored SIGTERM for ",
                   absl::FormatDuration(kCoordinatorStopTimeout), " and was killed"));
}

absl::StatusOr<ProcessSample> SampleProcess(pid_t pid) {
  const std::string dir = pid == 0 ? "/proc/self" : absl::StrCat("/proc/", pid);
  auto stat = ReadWholeFile(dir + "/stat");
  if (!stat.ok()) return stat.status();
  auto status = ReadWholeFile(dir + "/status");
  if (!status.ok()) return status.status();

  // The command name (field 2) may hold spaces; fields from 3 on follow the
  // last ')'. utime and stime are fields 14 and 15, num_threads field 20.
  const size_t close_paren = stat->rfind(')');
  if (close_paren == std::string::npos) {
    return absl::InternalError(absl::StrCat(dir, "/stat: no ')' in '", *stat, "'"));
  }
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(*stat).substr(close_paren + 1), ' ', absl::SkipWhitespace());
  constexpr size_t kUtime = 14 - 3, kStime = 15 - 3, kThreads = 20 - 3;
  int64_t utime = 0, stime = 0, threads = 0;
  if (fields.size() <= kThreads || !absl::SimpleAtoi(fields[kUtime], &utime) ||
      !absl::SimpleAtoi(fields[kStime], &stime) || !absl::SimpleAtoi(fields[kThreads], &threads)) {
    return absl::InternalError(absl::StrCat(dir, "/stat: cannot parse '", *stat, "'"));
  }
  ProcessSample sample;
  sample.cpu_seconds =
      static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
  sample.threads = static_cast<int>(threads);
  sample.rss_bytes = StatusFieldBytes(*status, "VmRSS:");
  sample.peak_rss_bytes = StatusFieldBytes(*status, "VmHWM:");
  return sample;
}

absl::StatusOr<double> MachineBusySeconds() {
  auto stat = ReadWholeFile("/proc/stat");
  if (!stat.ok()) return stat.status();
  // cpu  user nice system idle iowait irq softirq steal guest guest_nice;
  // guest time is already counted in user.
  std::vector<absl::string_view> fields = absl::StrSplit(
      absl::string_view(*stat).substr(0, stat->find('\n')), ' ', absl::SkipWhitespace());
  constexpr size_t kIdle = 4, kIowait = 5, kSteal = 8;
  if (fields.size() <= kSteal || fields[0] != "cpu") {
    return absl::InternalError(
        absl::StrCat("/proc/stat: unexpected first line in '", stat->substr(0, 80), "'"));
  }
  int64_t busy = 0;
  for (size_t i = 1; i <= kSteal; ++i) {
    int64_t ticks = 0;
    if (!absl::SimpleAtoi(fields[i], &ticks)) {
      return absl::InternalError(absl::StrCat("/proc/stat: bad field '", fields[i], "'"));
    }
    if (i != kIdle && i != kIowait) busy += ticks;
  }
  return static_cast<double>(busy) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

}  // namespace tessera::bench
