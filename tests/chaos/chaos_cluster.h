// ChaosCluster: the processes the chaos soak (chaos_soak.h) torments. Workers run on hosts of
// their own (network namespaces cabled to one bridge, tests/util/netns.h); the coordinators run
// in this machine's namespace, where a private PostgreSQL listens on loopback, and listen on the
// machine's address on the lab network, so a worker's cable to "the coordinator host" is the
// machine's cable (NetnsLab::PartitionFromMachine). With PostgreSQL there are two coordinators on
// one database (the leader and a standby, on fixed ports so a restarted one is found where it
// was); without it one coordinator on SQLite.
//
// Every daemon writes its log to a file of its own under the soak directory (a fresh file per
// incarnation), so no pipe fills while nobody reads it and a failure leaves the logs behind.
//
// Thread safety: one thread at a time.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"
#include "tests/util/netns.h"
#include "tests/util/subprocess.h"

namespace tessera::chaos {

struct ClusterOptions {
  // Where data, checkpoints, work dirs, the state and the logs go.
  std::string dir;
  // Directory of tessera-coordinator, tessera-worker and tessera-trainer.
  std::string bin_dir;
  // A text file to train on (tessera-trainer prepare turns it into token shards).
  std::string corpus;
  int workers = 3;
  // CPU slots of each worker.
  int cpu_slots = 1;
  // The PostgreSQL database of two coordinators; empty: one coordinator on SQLite.
  std::string postgres_url;
  // The coordinators' heartbeat timeout: a worker cut off longer than this is given up.
  std::string heartbeat_timeout = "5s";
};

class ChaosCluster {
 public:
  // Builds the network, prepares the data and starts every daemon; waits until every worker
  // has registered with the leader.
  static absl::StatusOr<std::unique_ptr<ChaosCluster>> Start(const ClusterOptions& options);
  ~ChaosCluster();

  int workers() const { return static_cast<int>(workers_.size()); }
  int coordinators() const { return static_cast<int>(coordinators_.size()); }
  bool ha() const { return coordinators_.size() > 1; }
  testing::NetnsLab& lab() { return *lab_; }
  const std::string& data_glob() const { return data_glob_; }
  std::string CheckpointDir(const std::string& job_id) const;
  // The directory every trainer's task file lies under (for pgrep).
  const std::string& dir() const { return options_.dir; }

  // Worker w lives on lab host w.
  bool WorkerUp(int w) const { return workers_[w].has_value(); }
  absl::Status KillWorker(int w);
  absl::Status StartWorker(int w);

  bool CoordinatorUp(int c) const { return coordinators_[c].has_value(); }
  // The up coordinator whose current log names the newest leader epoch (with one coordinator,
  // it); -1 when none.
  int Leader();
  absl::Status KillCoordinator(int c);
  absl::Status StartCoordinator(int c);

  // Pids of trainer processes (any job, any worker) whose task file lies under dir().
  std::vector<pid_t> TrainerPids() const;

  // Calls `call` on the leader first, then on the others, and returns the first OK answer's
  // status (or the last error): a standby refuses job calls, and a leader may have just died.
  template <typename Call>
  grpc::Status OnLeader(Call call) {
    grpc::Status status(grpc::StatusCode::UNAVAILABLE, "no coordinator is up");
    const int leader = Leader();
    for (int i = 0; i < coordinators(); ++i) {
      const int c = leader < 0 ? i : (leader + i) % coordinators();
      if (!coordinators_[c]) continue;
      status = call(*stubs_[c]);
      if (status.ok()) return status;
    }
    return status;
  }

  // Stops every daemon (SIGTERM, then SIGKILL) that is still up.
  void StopAll();

 private:
  explicit ChaosCluster(ClusterOptions options) : options_(std::move(options)) {}
  std::string LogPath(const std::string& name);

  ClusterOptions options_;
  std::unique_ptr<testing::NetnsLab> lab_;
  std::string data_glob_;
  std::vector<std::string> coordinator_addresses_;
  std::vector<std::optional<testing::Subprocess>> coordinators_;
  std::vector<std::string> coordinator_logs_;
  // Per coordinator: bytes of its current log read so far, and the newest epoch it said it leads
  // with (-1: none).
  std::vector<size_t> log_read_;
  std::vector<int64_t> epochs_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  std::vector<std::optional<testing::Subprocess>> workers_;
  int incarnation_ = 0;
};

}  // namespace tessera::chaos
