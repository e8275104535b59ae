// WorkerAgent: what a worker does for its node. It registers with the
// coordinator and heartbeats (task states, GPU metrics); starts one trainer
// process per assigned rank (own process group, torchrun environment, task
// file, per-rank log file) and supervises them (a failed rank stops its
// siblings; stop orders get SIGTERM then SIGKILL); receives the trainers'
// TrainerReports on a Unix socket and relays them to the coordinator in
// batches, keeping them while the coordinator is unreachable.
//
// Thread safety: public methods may be called from any thread. One
// absl::Mutex guards the tasks and the report queues; the heartbeat, the
// supervision and the relay loops and the socket readers each run on their
// own thread and never hold the mutex while calling the coordinator.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "worker/gpu_inventory.h"
#include "worker/trainer_process.h"

namespace tessera::worker {

struct WorkerAgentOptions {
  // Coordinator gRPC address.
  std::string coordinator_address = "127.0.0.1:50051";
  // Node identity in the cluster.
  std::string node_id;
  // Task files, logs and the report socket live here.
  std::string work_dir = "tessera-work";
  // Trainer ranks a node without GPUs runs at once.
  int cpu_slots = 0;
  // The tessera-trainer binary.
  std::string trainer_path;
  // Labels offered to node selectors.
  std::map<std::string, std::string> labels;
  // SIGTERM-to-SIGKILL grace when stopping trainers.
  absl::Duration stop_grace = absl::Seconds(10);
  // Period of the supervision and relay loops.
  absl::Duration poll_interval = absl::Milliseconds(200);
  // Deadline of each call to the coordinator.
  absl::Duration rpc_timeout = absl::Seconds(10);
};

class WorkerAgent {
 public:
  // `gpus` may be null (a CPU-only node).
  WorkerAgent(WorkerAgentOptions options, std::unique_ptr<GpuBackend> gpus);
  ~WorkerAgent();

  // Observers, set before Start(): each GPU sample (every heartbeat), and
  // each TrainerReport received from a trainer.
  void SetGpuObserver(
      std::function<void(const std::vector<v1::GpuDevice>&, const std::vector<GpuSample>&)>
          observer);
  void SetReportObserver(std::function<void(const v1::TrainerReport&)> observer);

  // Opens the report socket and starts the loops; the coordinator reaches
  // this worker's own service at `advertise_address` (host:port).
  absl::Status Start(const std::string& advertise_address);
  // Stops the loops and every trainer (SIGTERM, then SIGKILL).
  void Stop();

  // The log file of a rank of a job attempt on this node.
  absl::StatusOr<std::string> LogPath(const std::string& job_id, int attempt, int rank);
  // Ranks of `job_id`'s `attempt` running here (all of them when rank < 0).
  std::vector<int> Ranks(const std::string& job_id, int attempt, int rank);
  // Whether any rank of the attempt is still running.
  bool Running(const std::string& job_id, int attempt);
  // The node as this worker sees it.
  v1::Node NodeView();

 private:
  struct Rank {
    v1::TrainerTask task;
    std::string log_path;
    std::unique_ptr<TrainerProcess> process;
    std::optional<ExitStatus> exit;
    std::optional<v1::TrainerFailure> reported_failure;
  };
  struct Task {
    std::string task_id;
    std::string job_id;
    int attempt = 0;
    v1::TaskState state = v1::TASK_STATE_STARTING;
    v1::TrainerFailure failure;
    std::vector<Rank> ranks;
    // Reports not yet acknowledged; sequence of the first one.
    std::vector<v1::TrainerReport> unacked;
    int64_t next_sequence = 1;
    int64_t first_unacked = 1;
    bool status_sent_after_end = false;
  };

  void HeartbeatLoop();
  void SuperviseLoop();
  void RelayLoop();
  void AcceptLoop();
  void ReadReports(int fd);
  absl::Status RegisterNow();
  void LaunchLocked(const v1::TaskAssignment& assignment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StopTaskLocked(Task& task, v1::TaskState final_state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Task* FindTaskLocked(const std::string& job_id, int attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerAgentOptions options_;
  std::unique_ptr<GpuBackend> gpus_;
  std::vector<v1::GpuDevice> devices_;
  std::unique_ptr<v1::NodeService::Stub> coordinator_;
  std::string socket_path_;
  std::string advertise_address_;
  std::function<void(const std::vector<v1::GpuDevice>&, const std::vector<GpuSample>&)>
      gpu_observer_;
  std::function<void(const v1::TrainerReport&)> report_observer_;
  int listen_fd_ = -1;

  absl::Mutex mu_;
  std::map<std::string, Task> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GpuMetrics> last_gpu_metrics_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  // Connected trainers' report sockets, shut down by Stop().
  std::set<int> reader_fds_ ABSL_GUARDED_BY(mu_);

  absl::Notification stop_;
  std::vector<std::thread> threads_;
};

}  // namespace tessera::worker
