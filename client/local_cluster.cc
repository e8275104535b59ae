#include "client/local_cluster.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/daemon_process.h"

extern char** environ;

namespace tessera::client {
namespace {

// How long a daemon may take to print its "serving gRPC on" line.
constexpr absl::Duration kStartTimeout = absl::Seconds(30);
// How long a daemon may take to exit after SIGTERM before SIGKILL.
constexpr absl::Duration kStopTimeout = absl::Seconds(15);

bool HasTrainShards(const std::filesystem::path& dir) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("train-") && name.ends_with(".bin")) return true;
  }
  return false;
}

// Runs `tessera-trainer prepare` on `corpus` into `data_dir`, its output to `log_path`.
absl::Status PrepareCorpus(const std::string& bin_dir, const std::string& corpus,
                           const std::string& data_dir, const std::string& log_path) {
  if (HasTrainShards(data_dir)) return absl::OkStatus();
  std::vector<std::string> argv = {bin_dir + "/tessera-trainer", "prepare", "--input=" + corpus,
                                   "--output_dir=" + data_dir};
  std::vector<char*> args;
  for (auto& arg : argv) args.push_back(arg.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  pid_t pid = -1;
  const int error = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    return absl::NotFoundError(absl::StrCat(argv[0], ": cannot start: ", strerror(error)));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("preparing ", corpus, " into ", data_dir, " failed; see ", log_path));
  }
  return absl::OkStatus();
}

}  // namespace

std::string BundledCorpus(const std::string& bin_dir) {
  const std::filesystem::path dir =
      std::filesystem::path(bin_dir).parent_path() / "share" / "tessera" / "corpus";
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().extension() == ".txt") return entry.path().string();
  }
  return "";
}

absl::StatusOr<LocalDaemon> LocalCluster::Spawn(const std::string& name,
                                                std::vector<std::string> argv,
                                                const std::string& log_path) {
  // In their own process group: the daemons stop on SIGTERM from us, not on the terminal's Ctrl-C.
  auto serving = StartDaemon(argv, log_path, kStartTimeout);
  if (!serving.ok()) {
    return absl::Status(serving.status().code(),
                        absl::StrCat(name, ": ", serving.status().message()));
  }
  LocalDaemon daemon;
  daemon.name = name;
  daemon.log_path = log_path;
  daemon.pid = serving->pid;
  daemon.address = serving->address;
  daemon.metrics_port = serving->metrics_port;
  daemons_.push_back(daemon);
  return daemon;
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(
    const LocalClusterOptions& options) {
  std::error_code error;
  std::filesystem::create_directories(options.dir, error);
  if (error) return absl::FailedPreconditionError(absl::StrCat(options.dir, ": ", error.message()));
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  if (!options.corpus.empty()) {
    cluster->data_dir_ = options.dir + "/data";
    if (absl::Status prepared = PrepareCorpus(options.bin_dir, options.corpus, cluster->data_dir_,
                                              options.dir + "/prepare.log");
        !prepared.ok()) {
      return prepared;
    }
  }
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
    if (it->pid > 0) StopDaemon(it->pid, kStopTimeout);
  }
}

}  // namespace tessera::client
