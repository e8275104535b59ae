// WorkerAgent: what a worker does for its node. It registers with the
// coordinator and heartbeats (task states, GPU metrics, each rank's latest
// step time); starts one trainer process per assigned rank (own process
// group, torchrun environment, task file, per-rank log file, a pid file under
// <work_dir>/trainers) and supervises them: a failed rank stops its siblings,
// and the task blames the first failure that is not a consequence of another
// (FAILURE_KIND_PEER_FAILED); a rank whose heartbeats stop for the job's hang
// timeout is hung and is killed; stop orders get SIGTERM then SIGKILL. It
// receives the trainers' TrainerReports on a Unix socket, keeps their
// heartbeats to itself and relays the rest to the coordinator in batches,
// keeping them while the coordinator is unreachable. At start it kills the
// trainers a previous worker left behind (worker/orphans.h).
//
// Between heartbeats it keeps a WatchAssignments stream open (AssignmentWatch):
// each notice from the coordinator wakes the heartbeat loop at once, so new
// tasks start (and stop orders land) without waiting for the heartbeat period.
//
// Each task moves through a TaskLifecycle (worker/task_lifecycle.h); its ranks keep their own
// facts (exit, heartbeats, signals sent). Time comes from options.clock and trainers from
// options.launcher, so tests run the agent in-process on a simulated clock with fake trainers.
// The report path (socket readers, relay loop) is in worker_agent_reports.cc; leader epochs and the
// coordinator grace in worker_agent_leader.cc.
//
// Thread safety: public methods may be called from any thread. One
// absl::Mutex guards the tasks and the report queues; the heartbeat, the
// supervision and the relay loops and the socket readers each run on their
// own thread and never hold the mutex while calling the coordinator or while
// waiting for a trainer to stop. Trainers are spawned from the heartbeat
// thread, which lives until Stop() has stopped them: a trainer's
// parent-death signal (common/trainer_env.h) fires when that thread ends.
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
#include "common/clock.h"
#include "common/daemon/leader_channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "tessera/v1/node_service.grpc.pb.h"
#include "worker/assignment_watch.h"
#include "worker/gpu_inventory.h"
#include "worker/task_lifecycle.h"
#include "worker/trainer_launcher.h"
#include "worker/trainer_process.h"
#include "worker/training_metrics.h"

namespace tessera::worker {

struct WorkerAgentOptions {
  // Coordinator gRPC addresses, comma-separated (host:port[,host:port...]): calls follow the one
  // that leads (common/daemon/leader_channel.h).
  std::string coordinator_address = "127.0.0.1:50051";
  // Node identity in the cluster.
  std::string node_id;
  // Task files, logs and the report socket live here (required; main.cc picks a default outside
  // the current directory).
  std::string work_dir;
  // The local shard cache socket handed to every trainer (TrainerTask.shard_cache_socket,
  // worker/shard_cache.h); empty: the node keeps no checkpoint shards in memory.
  std::string shard_cache_socket;
  // Trainer ranks a node without GPUs runs at once.
  int cpu_slots = 0;
  // Intra-op threads of each trainer (OMP_NUM_THREADS, MKL_NUM_THREADS); 0: the cores this
  // process may run on divided by the node's slots (CPU slots, else GPUs), at least 1.
  int trainer_threads = 0;
  // The tessera-trainer binary.
  std::string trainer_path;
  // Labels offered to node selectors.
  std::map<std::string, std::string> labels;
  // Topology level -> the node's domain there (RegisterNodeRequest.topology).
  std::map<std::string, std::string> topology;
  // SIGTERM-to-SIGKILL grace when stopping trainers.
  absl::Duration stop_grace = absl::Seconds(10);
  // How long the ranks of a task asked to checkpoint and stop (a drained node) get to save their
  // checkpoint and exit before they are stopped as for a plain stop order.
  absl::Duration checkpoint_grace = absl::Minutes(10);
  // How long the trainers keep running while no coordinator answers as leader (its reports are
  // kept meanwhile); past it, each task's ranks are asked to save a checkpoint and stop (given
  // checkpoint_grace, as for a drained node) and the ends are reported once a leader answers.
  absl::Duration coordinator_grace = absl::Minutes(5);
  // Period of the supervision and relay loops.
  absl::Duration poll_interval = absl::Milliseconds(200);
  // Written into each TrainerTask: how often its rank sends a RankHeartbeat.
  absl::Duration trainer_heartbeat_interval = absl::Seconds(1);
  // How long a task whose failed ranks all blame a peer waits, while another
  // of its ranks still runs, for the cause to surface (kPeerFailureGrace).
  absl::Duration peer_failure_grace = absl::Seconds(1);
  // Deadline of each call to the coordinator.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Transport security of the calls to the coordinator; null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials;
  // Bearer token presented to the coordinator (a user with the node role); empty: none (a node
  // certificate, or a coordinator without authentication).
  std::string join_token;
  // This node's key (node_key.h): binds the node id at the coordinator.
  std::string node_key;
  // Watch for assignments (NodeService.WatchAssignments) and heartbeat as soon as the
  // coordinator has some; false: assignments arrive with the periodic heartbeat only.
  bool watch_assignments = true;
  // Reconnection of the watch stream.
  AssignmentWatchOptions watch;
  // Time of every deadline, timeout and timestamp the agent keeps, its assignment watch's backoff
  // included (not the gRPC deadlines, which gRPC measures on the wall clock). Not owned; outlives
  // the agent.
  Clock* clock = Clock::Real();
  // Starts the trainer ranks. Not owned; outlives the agent.
  TrainerLauncher* launcher = ProcessLauncher();
};

// Whether a leading coordinator answers the worker (its /metrics and tests).
struct CoordinatorContact {
  // The last registration or heartbeat was answered by the leader.
  bool reachable = false;
  // Since the leader last answered (since Start() before any answer); zero while reachable.
  absl::Duration without = absl::ZeroDuration();
  // The highest leader epoch seen (RegisterNodeResponse/HeartbeatResponse.leader_epoch); -1: none.
  int64_t leader_epoch = -1;
};

// The orders a heartbeat answer carries ("stop T, start U"), for the log line of an ignored one;
// empty when none.
std::string DescribeLeaderOrders(const v1::HeartbeatResponse& response);

// Intra-op threads per trainer: `requested` when positive, else `usable_cores` / `slots` (at
// least 1 each).
int TrainerThreads(int requested, int usable_cores, int slots);

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
  // Called with true once the node has registered with the coordinator, and with false when the
  // coordinator stops answering or asks for a new registration (readiness). Runs on the
  // heartbeat thread, outside the agent's lock.
  void SetRegistrationObserver(std::function<void(bool registered)> observer);

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
  // The ranks of unended tasks whose processes have not exited, each with the node's GPU it holds
  // and that GPU's UUID from the inventory (for TrainingMetrics).
  std::vector<RunningRank> RunningRanks();
  // The node as this worker sees it.
  v1::Node NodeView();
  // Whether the leader answers, and for how long it has not (on options.clock).
  CoordinatorContact Contact();

 private:
  struct Rank {
    v1::TrainerTask task;
    // The node's GPU the rank runs on (the process sees it as device 0); -1 on the CPU.
    int gpu = -1;
    std::string log_path;
    std::unique_ptr<TrainerHandle> process;
    absl::Time launched;
    std::optional<ExitStatus> exit;
    // When the supervise loop first saw the exit.
    absl::Time exit_seen;
    std::optional<v1::TrainerFailure> reported_failure;
    // Arrival of the latest RankHeartbeat, and what it said.
    std::optional<absl::Time> last_heartbeat;
    std::optional<v1::RankStepTime> step_time;
    // Set when the hang watchdog condemned the rank: killed, not stopped.
    bool hung = false;
    // Whether a report of the rank has arrived, and whether its report
    // stream has since ended (the reader saw end of file).
    bool reporting = false;
    bool reports_ended = false;
    // Sent kCheckpointAndStopSignal (only once the rank has reported: the trainer installs its
    // handler before it connects, and the signal's default action would kill it).
    bool checkpoint_signalled = false;
  };
  struct Task {
    std::string task_id;
    std::string job_id;
    int attempt = 0;
    TaskLifecycle lifecycle;
    // Set when the lifecycle ends FAILED.
    v1::TrainerFailure failure;
    std::vector<Rank> ranks;
    // Reports not yet acknowledged; sequence of the first one.
    std::vector<v1::TrainerReport> unacked;
    int64_t next_sequence = 1;
    int64_t first_unacked = 1;
    // When a failed rank was first seen, for the peer-failure grace.
    std::optional<absl::Time> first_failure_seen;
    // Until when the end of the task is held back for its unrelayed reports.
    std::optional<absl::Time> drain_deadline;
    // Until when the end of the task is held back for ranks whose processes have not exited.
    std::optional<absl::Time> exit_deadline;
    // Whether the end going out past exit_deadline was logged.
    bool exit_overdue_logged = false;
    // The assignment of a task not launched yet (lifecycle kPending or kStopBeforeLaunch): ranks
    // of a task being stopped still hold one of its GPUs or its master port, or another attempt
    // of its job still runs here (HeldBackByLocked).
    std::optional<v1::TaskAssignment> deferred;
  };

  // One unary call to the leading coordinator, with failover (LeaderChannel) within
  // options_.rpc_timeout; `call` gets a stub of the address being tried and a prepared context.
  grpc::Status CallLeader(
      const std::function<grpc::Status(v1::NodeService::Stub&, grpc::ClientContext&)>& call);
  // Credentials of a call to the coordinator (the watch stream has no fixed deadline).
  void Authorize(grpc::ClientContext& context) const;
  void HeartbeatLoop();
  // Waits `wait`, or less when WakeHeartbeat() is called; false once Stop() began.
  bool WaitForHeartbeat(absl::Duration wait);
  // Makes the heartbeat loop heartbeat now (a notice from the coordinator).
  void WakeHeartbeat();
  // Waits `wait` on the clock; true once Stop() began (the supervise and relay loops' period).
  bool WaitForStop(absl::Duration wait);
  void SuperviseLoop();
  void RelayLoop();
  void AcceptLoop();
  void ReadReports(int fd);
  absl::Status RegisterNow();
  // Takes a new task: launches its ranks, or defers them while HeldBackByLocked names a task.
  void LaunchLocked(const v1::TaskAssignment& assignment) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LaunchRanksLocked(Task& task, const v1::TaskAssignment& assignment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What keeps `task` (to run `assignment`) from launching now, empty if nothing: a live rank of
  // another task that is being stopped and holds one of its GPUs or its master port, or of
  // another attempt of its job. Two trainers on one GPU could both run out of its memory, and two
  // rendezvous cannot share a port. Only tasks on their way out hold a launch back, so it waits
  // for the stop grace at most, never for a task the coordinator still wants.
  // Reads the exits as last polled.
  std::string HeldBackByLocked(const Task& task, const v1::TaskAssignment& assignment) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Launches deferred tasks that nothing holds back any more (a stopped one ends unlaunched).
  void LaunchDeferredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls a running rank; on its exit records the time and removes its pid file.
  void PollRankLocked(Rank& rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordExitLocked(Rank& rank, ExitStatus exit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Polls the task's ranks; whether none of their processes is left.
  bool ProcessesGoneLocked(Task& task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Decides a running task's state from its ranks' exits and heartbeats.
  void JudgeTaskLocked(Task& task, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends kCheckpointAndStopSignal to each running rank of a task asked to checkpoint and stop
  // that has reported and was not signalled yet.
  void SignalCheckpointLocked(Task& task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The failure of a rank that exited non-zero: its own typed report, else
  // the exit status; stamped with when the exit was seen if it has no time.
  v1::TrainerFailure ExitFailureLocked(const Rank& rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What heartbeats and registrations say of `task`: RUNNING still for an ended task whose
  // reports are not all relayed, or one of whose ranks' processes has not exited (each up to a
  // deadline it sets on first call).
  v1::TaskStatus TaskStatusLocked(Task& task, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Task* FindTaskLocked(const std::string& job_id, int attempt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UNAVAILABLE (so that the call fails over) when `epoch`, that of the coordinator at `address`
  // which answered, is below the highest epoch seen: a deposed leader, whose `orders` (a
  // description, empty when none) are logged and ignored.
  grpc::Status RefuseDeposedLeader(int64_t epoch, const std::string& address,
                                   const std::string& orders) ABSL_LOCKS_EXCLUDED(mu_);
  // Records whether the leader answered the latest registration or heartbeat.
  void LeaderAnsweredLocked(bool answered) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Past options_.coordinator_grace without a leader: asks the running tasks' ranks to checkpoint
  // and stop (once per task), and stops the tasks not launched yet.
  void EnforceCoordinatorGraceLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const WorkerAgentOptions options_;
  Clock* const clock_;
  std::unique_ptr<GpuBackend> gpus_;
  std::vector<v1::GpuDevice> devices_;
  // The coordinators, and which of them leads.
  std::unique_ptr<LeaderChannel> leader_;
  // Why options_.coordinator_address cannot be used; Start() returns it.
  absl::Status address_error_;
  std::string socket_path_;
  // Pid files of launched trainers (worker/orphans.h).
  std::string pid_dir_;
  // OMP_NUM_THREADS / MKL_NUM_THREADS of every trainer (TrainerThreads).
  int trainer_threads_ = 1;
  std::string advertise_address_;
  std::function<void(const std::vector<v1::GpuDevice>&, const std::vector<GpuSample>&)>
      gpu_observer_;
  std::function<void(const v1::TrainerReport&)> report_observer_;
  std::function<void(bool)> registration_observer_;
  int listen_fd_ = -1;

  absl::Mutex mu_;
  std::map<std::string, Task> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::GpuMetrics> last_gpu_metrics_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  // The highest leader epoch any answer carried: orders of a lower one are ignored.
  std::optional<int64_t> leader_epoch_ ABSL_GUARDED_BY(mu_);
  // Whether the leader answered the latest registration or heartbeat, and when it last did
  // (Start() before the first answer).
  bool leader_answering_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time leader_answered_ ABSL_GUARDED_BY(mu_);
  // Connected trainers' report sockets, shut down by Stop().
  std::set<int> reader_fds_ ABSL_GUARDED_BY(mu_);

  absl::Notification stop_;
  // Wakes the heartbeat loop early (WaitForHeartbeat) and ends the loops' waits; a leaf mutex.
  absl::Mutex wake_mu_;
  bool heartbeat_now_ ABSL_GUARDED_BY(wake_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(wake_mu_) = false;
  // Null when options_.watch_assignments is false.
  std::unique_ptr<AssignmentWatch> watch_;
  std::vector<std::thread> threads_;
};

}  // namespace tessera::worker
