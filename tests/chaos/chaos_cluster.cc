#include "tests/chaos/chaos_cluster.h"

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/daemon/server.h"
#include "common/status_macros.h"
#include "tests/util/free_port.h"
#include "tests/util/wait.h"

namespace tessera::chaos {
namespace {

using testing::RunCommand;
using testing::Subprocess;

// Runs `argv` through /bin/sh with stdout and stderr appended to `log`; `exec` keeps the pid the
// daemon's (and `ip netns exec` replaces itself too), so a signal to the Subprocess reaches it.
std::vector<std::string> Logged(const std::vector<std::string>& argv, const std::string& log) {
  std::vector<std::string> quoted;
  for (const std::string& arg : argv) quoted.push_back(absl::StrCat("'", arg, "'"));
  return {"/bin/sh", "-c",
          absl::StrCat("exec ", absl::StrJoin(quoted, " "), " >> '", log, "' 2>&1 < /dev/null")};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChaosCluster>> ChaosCluster::Start(const ClusterOptions& options) {
  std::unique_ptr<ChaosCluster> cluster(new ChaosCluster(options));
  ASSIGN_OR_RETURN(cluster->lab_, testing::NetnsLab::Create(options.workers));
  std::filesystem::create_directories(options.dir + "/logs");

  ASSIGN_OR_RETURN(
      testing::RunResult prepared,
      RunCommand({options.bin_dir + "/tessera-trainer", "prepare", "--input=" + options.corpus,
                  "--output_dir=" + options.dir + "/data"},
                 absl::Minutes(2)));
  if (prepared.exit.exit_code != 0) {
    return absl::InternalError(absl::StrCat("tessera-trainer prepare failed: ", prepared.output));
  }
  cluster->data_glob_ = options.dir + "/data/train-*.bin";

  const int coordinators = options.postgres_url.empty() ? 1 : 2;
  for (int c = 0; c < coordinators; ++c) {
    ASSIGN_OR_RETURN(int port, testing::PickFreePort());
    cluster->coordinator_addresses_.push_back(absl::StrCat(cluster->lab_->MachineIp(), ":", port));
    cluster->coordinators_.emplace_back();
    cluster->coordinator_logs_.emplace_back();
    cluster->log_read_.push_back(0);
    cluster->epochs_.push_back(-1);
    cluster->stubs_.push_back(
        v1::Coordinator::NewStub(MakeClientChannel(cluster->coordinator_addresses_.back())));
  }
  for (int c = 0; c < coordinators; ++c) {
    RETURN_IF_ERROR(cluster->StartCoordinator(c));
    // The first leads; the second then stands by.
    if (c == 0 && !testing::WaitUntil([&] { return cluster->Leader() == 0; }, absl::Seconds(60),
                                      absl::Milliseconds(100))) {
      return absl::DeadlineExceededError(absl::StrCat("the first coordinator did not lead: ",
                                                      ReadFile(cluster->coordinator_logs_[0])));
    }
  }
  cluster->workers_.resize(options.workers);
  for (int w = 0; w < options.workers; ++w) RETURN_IF_ERROR(cluster->StartWorker(w));
  const bool registered = testing::WaitUntil(
      [&] {
        v1::ListNodesResponse nodes;
        grpc::Status listed = cluster->OnLeader([&](v1::Coordinator::Stub& stub) {
          grpc::ClientContext context;
          context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
          return stub.ListNodes(&context, {}, &nodes);
        });
        return listed.ok() && nodes.nodes_size() == options.workers;
      },
      absl::Seconds(60), absl::Milliseconds(200));
  if (!registered) return absl::DeadlineExceededError("the workers did not register in 60 s");
  return cluster;
}

ChaosCluster::~ChaosCluster() { StopAll(); }

std::string ChaosCluster::LogPath(const std::string& name) {
  return absl::StrCat(options_.dir, "/logs/", name, ".", ++incarnation_, ".log");
}

std::string ChaosCluster::CheckpointDir(const std::string& job_id) const {
  return absl::StrCat(options_.dir, "/ckpt/", job_id);
}

absl::Status ChaosCluster::StartCoordinator(int c) {
  if (coordinators_[c]) return absl::FailedPreconditionError("coordinator already up");
  std::vector<std::string> argv = {
      options_.bin_dir + "/tessera-coordinator", "--listen=" + coordinator_addresses_[c],
      "--metrics_listen=", "--insecure", "--checkpoint_root=" + options_.dir + "/ckpt",
      // Rendezvous ports apart from other test processes' (the same base on both coordinators:
      // one leads at a time).
      absl::StrCat("--master_port_base=", 30000 + (getpid() % 1000) * 10),
      "--heartbeat_interval=500ms", "--heartbeat_timeout=" + options_.heartbeat_timeout};
  if (options_.postgres_url.empty()) {
    argv.push_back("--state=" + options_.dir + "/state.db");
  } else {
    argv.insert(argv.end(), {"--state=" + options_.postgres_url, "--leader_lease_seconds=2",
                             "--standby_poll_seconds=0.2"});
  }
  coordinator_logs_[c] = LogPath(absl::StrCat("coordinator-", c));
  log_read_[c] = 0;
  epochs_[c] = -1;
  ASSIGN_OR_RETURN(Subprocess process, Subprocess::Start(Logged(argv, coordinator_logs_[c])));
  coordinators_[c].emplace(std::move(process));
  return absl::OkStatus();
}

absl::Status ChaosCluster::KillCoordinator(int c) {
  if (!coordinators_[c]) return absl::FailedPreconditionError("coordinator not up");
  absl::StatusOr<testing::ExitInfo> stopped = coordinators_[c]->Stop(SIGKILL);
  coordinators_[c].reset();
  return stopped.status();
}

int ChaosCluster::Leader() {
  static const std::regex kLeading(R"(leading with epoch (\d+))");
  int leader = -1;
  int64_t newest_epoch = -1;
  for (int c = 0; c < coordinators(); ++c) {
    if (!coordinators_[c]) continue;
    if (!ha()) return c;
    // Only what the log gained since the last look: it is read on every call to a coordinator.
    std::ifstream in(coordinator_logs_[c]);
    in.seekg(static_cast<std::streamoff>(log_read_[c]));
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // a line still being written: read it whole next time
      log_read_[c] += line.size() + 1;
      std::smatch match;
      if (std::regex_search(line, match, kLeading)) epochs_[c] = std::stoll(match[1]);
    }
    if (epochs_[c] > newest_epoch) {
      newest_epoch = epochs_[c];
      leader = c;
    }
  }
  return leader;
}

absl::Status ChaosCluster::StartWorker(int w) {
  if (workers_[w]) return absl::FailedPreconditionError("worker already up");
  const std::string name = absl::StrCat("chaos-w", w);
  const std::string ip = lab_->Ip(w);
  std::vector<std::string> argv = {options_.bin_dir + "/tessera-worker",
                                   "--coordinator=" + absl::StrJoin(coordinator_addresses_, ","),
                                   "--listen=" + ip + ":0",
                                   "--metrics_listen=" + ip + ":0",
                                   "--insecure",
                                   "--node_name=" + name,
                                   absl::StrCat("--cpu_slots=", options_.cpu_slots),
                                   "--work_dir=" + options_.dir + "/" + name,
                                   "--stop_grace=2s",
                                   "--trainer_threads=1"};
  ASSIGN_OR_RETURN(Subprocess process, Subprocess::Start(lab_->On(w, Logged(argv, LogPath(name)))));
  workers_[w].emplace(std::move(process));
  return absl::OkStatus();
}

absl::Status ChaosCluster::KillWorker(int w) {
  if (!workers_[w]) return absl::FailedPreconditionError("worker not up");
  absl::StatusOr<testing::ExitInfo> stopped = workers_[w]->Stop(SIGKILL);
  workers_[w].reset();
  return stopped.status();
}

std::vector<pid_t> ChaosCluster::TrainerPids() const {
  // "[-]-task" keeps pgrep from matching the shell that runs it.
  absl::StatusOr<testing::RunResult> pgrep = RunCommand(
      {"/bin/sh", "-c", "pgrep -f '[-]-task=" + options_.dir + "/' || true"}, absl::Seconds(10));
  std::vector<pid_t> pids;
  if (!pgrep.ok()) return pids;
  for (absl::string_view line : absl::StrSplit(pgrep->output, '\n', absl::SkipEmpty())) {
    pids.push_back(std::stoi(std::string(line)));
  }
  return pids;
}

void ChaosCluster::StopAll() {
  for (std::optional<Subprocess>& worker : workers_) {
    if (worker) worker->Stop(SIGTERM).IgnoreError();  // SIGKILLed by Stop when it hangs
    worker.reset();
  }
  for (std::optional<Subprocess>& coordinator : coordinators_) {
    if (coordinator) coordinator->Stop(SIGTERM).IgnoreError();
    coordinator.reset();
  }
}

}  // namespace tessera::chaos
