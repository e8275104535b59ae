#include "worker/orphans.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/errno_status.h"
#include "worker/proc_stat.h"

namespace tessera::worker {
namespace {

constexpr absl::Duration kGonePollInterval = absl::Milliseconds(10);

// Whether `record`'s process is still there: same pid, same start time, and not a zombie (a
// zombie holds no resources and waits only for its parent, or init, to reap it).
bool StillRunning(const TrainerRecord& record) {
  absl::StatusOr<ProcStat> stat = ReadProcStat(record.pid);
  return stat.ok() && stat->start_time == record.start_time && stat->state != 'Z' &&
         stat->state != 'X';
}

}  // namespace

std::string PidFilePath(const std::string& dir, pid_t pid) {
  return absl::StrCat(dir, "/", pid, ".pid");
}

absl::Status RecordTrainer(const std::string& dir, pid_t pid, const std::string& task_id,
                           int rank) {
  absl::StatusOr<ProcStat> stat = ReadProcStat(pid);
  if (!stat.ok()) return stat.status();
  return WritePidFile(
      dir, {.pid = pid, .task_id = task_id, .rank = rank, .start_time = stat->start_time});
}

absl::Status WritePidFile(const std::string& dir, const TrainerRecord& record) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return ErrnoToStatus(error.value(), absl::StrCat("creating pid directory ", dir));
  const std::string path = PidFilePath(dir, record.pid);
  const std::string temporary = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(temporary, std::ios::trunc);
    out << "pid=" << record.pid << "\ntask_id=" << record.task_id << "\nrank=" << record.rank
        << "\nstart_time=" << record.start_time << "\n";
    out.close();
    if (!out) return absl::InternalError(absl::StrCat("cannot write pid file ", temporary));
  }
  if (rename(temporary.c_str(), path.c_str()) != 0) {
    const int rename_error = errno;
    unlink(temporary.c_str());
    return ErrnoToStatus(rename_error, absl::StrCat("renaming ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

absl::Status RemovePidFile(const std::string& dir, pid_t pid) {
  const std::string path = PidFilePath(dir, pid);
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, absl::StrCat("removing pid file ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainerRecord> ReadPidFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open pid file ", path));
  TrainerRecord record;
  bool has_pid = false, has_start_time = false;
  std::string line;
  while (std::getline(in, line)) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    if (kv.first == "pid") {
      int64_t pid = 0;
      has_pid = absl::SimpleAtoi(kv.second, &pid) && pid > 0;
      record.pid = static_cast<pid_t>(pid);
    } else if (kv.first == "task_id") {
      record.task_id = kv.second;
    } else if (kv.first == "rank") {
      if (!absl::SimpleAtoi(kv.second, &record.rank)) record.rank = -1;
    } else if (kv.first == "start_time") {
      has_start_time = absl::SimpleAtoi(kv.second, &record.start_time);
    }
  }
  if (!has_pid || !has_start_time) {
    return absl::InvalidArgumentError(
        absl::StrCat("pid file ", path, ": needs pid=<pid> and start_time=<ticks> lines"));
  }
  return record;
}

absl::StatusOr<OrphanSweep> KillOrphanedTrainers(const std::string& dir, absl::Duration timeout) {
  OrphanSweep sweep;
  std::error_code error;
  if (!std::filesystem::exists(dir, error)) return sweep;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string path = entry.path().string();
    if (entry.path().extension() == ".pid") files.push_back(path);
    // A temporary left by a worker that died while writing a record.
    if (entry.path().extension() == ".tmp") std::filesystem::remove(entry.path(), error);
  }
  if (error) return ErrnoToStatus(error.value(), absl::StrCat("listing pid directory ", dir));

  for (const std::string& path : files) {
    absl::StatusOr<TrainerRecord> record = ReadPidFile(path);
    if (!record.ok()) {
      sweep.unreadable.push_back(std::string(record.status().message()));
      continue;
    }
    if (!StillRunning(*record)) {
      sweep.stale.push_back(*record);
      continue;
    }
    // The trainer leads its own group (TrainerProcess spawns it so): the group takes its
    // data-loader helpers with it. A leader that has since changed group is signalled alone.
    absl::StatusOr<ProcStat> stat = ReadProcStat(record->pid);
    const bool leads_group = stat.ok() && stat->process_group == record->pid;
    kill(leads_group ? -record->pid : record->pid, SIGKILL);
    sweep.killed.push_back(*record);
  }

  const absl::Time deadline = absl::Now() + timeout;
  std::vector<TrainerRecord> waiting = sweep.killed;
  while (!waiting.empty()) {
    std::erase_if(waiting, [](const TrainerRecord& record) { return !StillRunning(record); });
    if (waiting.empty() || absl::Now() >= deadline) break;
    absl::SleepFor(kGonePollInterval);
  }
  sweep.survived = waiting;
  // A survivor's record stays, for the next worker to try again.
  for (const std::string& path : files) {
    const bool survivor = std::any_of(waiting.begin(), waiting.end(), [&](const auto& record) {
      return PidFilePath(dir, record.pid) == path;
    });
    if (!survivor) std::filesystem::remove(path, error);
  }
  return sweep;
}

}  // namespace tessera::worker
