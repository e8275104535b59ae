#include "client/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace tessera::client {
namespace {

// How long a daemon may take to print its "serving gRPC on" line.
constexpr absl::Duration kStartTimeout = absl::Seconds(30);
// How long a daemon may take to exit after SIGTERM before SIGKILL.
constexpr absl::Duration kStopTimeout = absl::Seconds(15);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void StopProcess(pid_t pid) {
  kill(pid, SIGTERM);
  absl::Time deadline = absl::Now() + kStopTimeout;
  while (absl::Now() < deadline) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) return;
    absl::SleepFor(absl::Milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

}  // namespace

absl::StatusOr<LocalDaemon> LocalCluster::Spawn(const std::string& name,
                                                std::vector<std::string> argv,
                                                const std::string& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  // The daemons stop on SIGTERM from us, not on the terminal's Ctrl-C.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  std::vector<char*> args;
  for (auto& arg : argv) args.push_back(arg.data());
  args.push_back(nullptr);
  LocalDaemon daemon;
  daemon.name = name;
  daemon.log_path = log_path;
  int rc = posix_spawn(&daemon.pid, args[0], &actions, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::NotFoundError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  daemons_.push_back(daemon);
  static const std::regex kServing(R"(serving gRPC on (\S+:\d+)(, metrics on port (\d+))?)");
  absl::Time deadline = absl::Now() + kStartTimeout;
  while (absl::Now() < deadline) {
    std::string log = ReadFile(log_path);
    std::smatch match;
    if (std::regex_search(log, match, kServing)) {
      daemons_.back().address = match[1];
      if (match[3].matched) daemons_.back().metrics_port = std::stoi(match[3]);
      return daemons_.back();
    }
    if (waitpid(daemon.pid, nullptr, WNOHANG) == daemon.pid) {
      daemons_.back().pid = -1;
      return absl::UnavailableError(absl::StrCat(name, " exited: ", log));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::UnavailableError(absl::StrCat(name, " did not start: ", ReadFile(log_path)));
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  std::error_code error;
  std::filesystem::create_directories(options.dir, error);
  if (error) return absl::FailedPreconditionError(absl::StrCat(options.dir, ": ", error.message()));
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  auto coordinator =
      cluster->Spawn("coordinator",
                     {options.bin_dir + "/tessera-coordinator", "--listen=127.0.0.1:0",
                      "--metrics_listen=127.0.0.1:0", "--state=" + options.dir + "/coordinator.db",
                      "--checkpoint_root=" + options.dir + "/checkpoints"},
                     options.dir + "/coordinator.log");
  if (!coordinator.ok()) return coordinator.status();
  for (int i = 0; i < options.workers; ++i) {
    std::string name = absl::StrCat("worker-", i);
    auto worker = cluster->Spawn(
        name,
        {options.bin_dir + "/tessera-worker", "--coordinator=" + coordinator->address,
         "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0", "--node_name=local-" + name,
         absl::StrCat("--cpu_slots=", options.cpu_slots), "--work_dir=" + options.dir + "/" + name},
        options.dir + "/" + name + ".log");
    if (!worker.ok()) return worker.status();
  }
  return cluster;
}

LocalCluster::~LocalCluster() {
  // Workers first, so they stop their trainers while the coordinator still
  // listens.
  for (auto it = daemons_.rbegin(); it != daemons_.rend(); ++it) {
    if (it->pid > 0) StopProcess(it->pid);
  }
}

}  // namespace tessera::client
