#include "bench/control_plane_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <iostream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/daemon_process.h"
#include "common/read_file.h"
#include "common/status_macros.h"

namespace tessera::bench {
namespace {

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
      absl::StrCat("--state=",
                   options.state.empty() ? absl::StrCat(options.dir, "/state.db") : options.state),
      absl::StrCat("--checkpoint_root=", options.dir, "/checkpoints"),
      absl::StrCat("--heartbeat_timeout=", absl::FormatDuration(options.heartbeat_timeout)),
      // The load generator is one anonymous user offering a whole organisation's jobs: the
      // per-user submission limit would cap it at 1 job/s and measure the limiter, not the
      // scheduler.
      "--max_submits_per_minute=0"};
  if (!options.database_password_file.empty()) {
    argv.push_back(absl::StrCat("--database_password_file=", options.database_password_file));
  }
  if (!options.queue_file.empty()) {
    argv.push_back(absl::StrCat("--queue_file=", options.queue_file));
  }
  // Its own process group: a Ctrl-C on the benchmark reaches us, and our destructor stops the
  // coordinator.
  ASSIGN_OR_RETURN(ServingDaemon daemon, StartDaemon(argv, log_path, kCoordinatorStartTimeout));
  std::unique_ptr<CoordinatorProcess> process(new CoordinatorProcess(daemon.pid, log_path));
  process->address_ = daemon.address;
  process->metrics_port_ = daemon.metrics_port;
  return process;
}

CoordinatorProcess::~CoordinatorProcess() {
  if (const absl::Status status = Stop(); !status.ok()) {
    std::cerr << "control_plane_bench: stopping the coordinator: " << status << "\n";
  }
}

absl::Status CoordinatorProcess::Stop() {
  if (pid_ <= 0) return absl::OkStatus();
  const pid_t pid = std::exchange(pid_, -1);
  if (StopDaemon(pid, kCoordinatorStopTimeout)) return absl::OkStatus();
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
  sample.exited = !fields.empty() && (fields[0] == "Z" || fields[0] == "X");
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
