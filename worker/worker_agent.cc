#include "worker/worker_agent.h"

#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/daemon/grpc_status.h"
#include "common/daemon/server.h"
#include "common/trainer_env.h"
#include "common/version.h"
#include "grpcpp/client_context.h"
#include "worker/failure_policy.h"
#include "worker/orphans.h"
#include "worker/proc_stat.h"
#include "worker/rendezvous_socket.h"

namespace tessera::worker {
namespace {

// How long an ended task's state waits for its queued reports to be relayed (TaskStatusLocked).
constexpr absl::Duration kReportDrainTimeout = absl::Seconds(30);
// How long, beyond the stop grace, an ended task's state waits for its ranks' processes to exit.
constexpr absl::Duration kRankExitTimeout = absl::Seconds(30);

// Lines of a failed rank's log quoted in its failure message.
constexpr int kFailureLogLines = 20;

std::string Hostname() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

bool IsTerminal(v1::TaskState state) {
  return state == v1::TASK_STATE_SUCCEEDED || state == v1::TASK_STATE_FAILED ||
         state == v1::TASK_STATE_STOPPED;
}

// Cores this process may run on (its affinity mask, which a container's cpuset narrows).
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace

int TrainerThreads(int requested, int usable_cores, int slots) {
  if (requested > 0) return requested;
  return std::max(1, usable_cores / std::max(1, slots));
}

WorkerAgent::WorkerAgent(WorkerAgentOptions options, std::unique_ptr<GpuBackend> gpus)
    : options_(std::move(options)), clock_(options_.clock), gpus_(std::move(gpus)) {
  if (gpus_) devices_ = gpus_->Devices();
  trainer_threads_ = TrainerThreads(
      options_.trainer_threads, UsableCores(),
      options_.cpu_slots > 0 ? options_.cpu_slots : static_cast<int>(devices_.size()));
  absl::StatusOr<std::vector<std::string>> addresses =
      ParseCoordinatorAddresses(options_.coordinator_address, "--coordinator");
  if (!addresses.ok()) address_error_ = addresses.status();
  leader_ = std::make_unique<LeaderChannel>(LeaderChannelOptions{
      .addresses =
          addresses.ok() ? *addresses : std::vector<std::string>{options_.coordinator_address},
      .credentials = options_.coordinator_credentials});
  socket_path_ = absl::StrCat(options_.work_dir, "/reports.sock");
  pid_dir_ = absl::StrCat(options_.work_dir, "/trainers");
  if (options_.watch_assignments) {
    AssignmentWatchOptions watch_options = options_.watch;
    watch_options.clock = clock_;
    watch_ = std::make_unique<AssignmentWatch>(
        leader_.get(), [this](grpc::ClientContext& context) { Authorize(context); },
        [this]() -> std::optional<v1::WatchAssignmentsRequest> {
          absl::MutexLock lock(&mu_);
          if (!registered_) return std::nullopt;
          v1::WatchAssignmentsRequest request;
          request.set_node_id(options_.node_id);
          request.set_node_key(options_.node_key);
          return request;
        },
        [this] { WakeHeartbeat(); }, watch_options);
  }
}

grpc::Status WorkerAgent::CallLeader(
    const std::function<grpc::Status(v1::NodeService::Stub&, grpc::ClientContext&)>& call) {
  // gRPC measures deadlines on the wall clock, whatever options_.clock is.
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  return leader_->CallService<v1::NodeService>(
      deadline, [&](grpc::ClientContext& context) { Authorize(context); }, call);
}

void WorkerAgent::Authorize(grpc::ClientContext& context) const {
  if (!options_.join_token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.join_token));
  }
}

WorkerAgent::~WorkerAgent() { Stop(); }

void WorkerAgent::SetGpuObserver(
    std::function<void(const std::vector<v1::GpuDevice>&, const std::vector<GpuSample>&)>
        observer) {
  gpu_observer_ = std::move(observer);
}

void WorkerAgent::SetReportObserver(std::function<void(const v1::TrainerReport&)> observer) {
  report_observer_ = std::move(observer);
}

void WorkerAgent::SetRegistrationObserver(std::function<void(bool registered)> observer) {
  registration_observer_ = std::move(observer);
}

absl::Status WorkerAgent::Start(const std::string& advertise_address) {
  advertise_address_ = advertise_address;
  if (!address_error_.ok()) return address_error_;
  if (options_.work_dir.empty()) return absl::InvalidArgumentError("--work_dir: empty");
  std::error_code error;
  std::filesystem::create_directories(options_.work_dir, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("--work_dir ", options_.work_dir, ": ", error.message()));
  }
  // Before registering: the coordinator must not count on ranks a crashed predecessor left
  // running, and they must not hold this node's GPUs.
  absl::StatusOr<OrphanSweep> sweep = KillOrphanedTrainers(pid_dir_);
  if (!sweep.ok()) {
    std::cerr << "tessera-worker: cannot check for trainers left by a previous worker: "
              << sweep.status() << std::endl;
  } else {
    for (const TrainerRecord& record : sweep->killed) {
      std::cerr << "tessera-worker: killed trainer pid " << record.pid << " (task "
                << record.task_id << ", rank " << record.rank
                << ") left running by a previous worker" << std::endl;
    }
    for (const TrainerRecord& record : sweep->survived) {
      std::cerr << "tessera-worker: trainer pid " << record.pid << " (task " << record.task_id
                << ", rank " << record.rank << ") is still alive " << kOrphanKillTimeout
                << " after SIGKILL" << std::endl;
    }
    for (const std::string& problem : sweep->unreadable) {
      std::cerr << "tessera-worker: ignored " << problem << std::endl;
    }
  }
  sockaddr_un addr{};
  if (socket_path_.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--work_dir ", options_.work_dir,
                                                   ": too long for a Unix socket path (",
                                                   socket_path_, ")"));
  }
  unlink(socket_path_.c_str());
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("report socket ", socket_path_, ": ", std::strerror(errno)));
  }
  {
    absl::MutexLock lock(&mu_);
    leader_answered_ = clock_->Now();
  }
  threads_.emplace_back([this] { AcceptLoop(); });
  threads_.emplace_back([this] { HeartbeatLoop(); });
  threads_.emplace_back([this] { SuperviseLoop(); });
  threads_.emplace_back([this] { RelayLoop(); });
  if (watch_) watch_->Start();
  return absl::OkStatus();
}

bool WorkerAgent::WaitForHeartbeat(absl::Duration wait) {
  absl::MutexLock lock(&wake_mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) {
    return heartbeat_now_ || stopping_;
  };
  clock_->AwaitWithDeadline(&wake_mu_, absl::Condition(&woken), clock_->Now() + wait);
  heartbeat_now_ = false;
  return !stopping_;
}

bool WorkerAgent::WaitForStop(absl::Duration wait) {
  absl::MutexLock lock(&wake_mu_);
  return clock_->AwaitWithDeadline(&wake_mu_, absl::Condition(&stopping_), clock_->Now() + wait);
}

void WorkerAgent::WakeHeartbeat() {
  absl::MutexLock lock(&wake_mu_);
  heartbeat_now_ = true;
}

void WorkerAgent::Stop() {
  if (stop_.HasBeenNotified()) return;
  stop_.Notify();
  {
    absl::MutexLock lock(&wake_mu_);
    stopping_ = true;
  }
  if (watch_) watch_->Stop();
  // A call waiting between rounds of failover returns now.
  leader_->Shutdown();
  // The trainers first, while their report sockets are open and the thread that spawned them
  // lives: either closing would SIGKILL them at once, with no SIGTERM grace.
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, task] : tasks_) {
      for (auto& rank : task.ranks) {
        if (rank.process && !rank.exit)
          RecordExitLocked(rank, rank.process->Stop(options_.stop_grace));
      }
    }
  }
  if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
  {
    absl::MutexLock lock(&mu_);
    for (int fd : reader_fds_) shutdown(fd, SHUT_RDWR);
  }
  for (auto& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
  unlink(socket_path_.c_str());
}

v1::TaskStatus WorkerAgent::TaskStatusLocked(Task& task, absl::Time now) {
  v1::TaskStatus status;
  status.set_task_id(task.task_id);
  status.set_job_id(task.job_id);
  status.set_attempt(task.attempt);
  status.set_state(task.lifecycle.state());
  // The end of a task goes out after its last reports, so that the coordinator has every step
  // when it records the end (reports queue up while it is unreachable); a coordinator that keeps
  // refusing them delays the end by kReportDrainTimeout at most.
  if (task.lifecycle.ended() && !task.unacked.empty()) {
    if (!task.drain_deadline) task.drain_deadline = now + kReportDrainTimeout;
    if (now < *task.drain_deadline) {
      status.set_state(v1::TASK_STATE_RUNNING);
      return status;
    }
  }
  // Nor does it go out while a rank's process lives (a failed rank's siblings being stopped): the
  // coordinator frees the task's slots, GPUs and master port on its end, and a restart placed on
  // them at once found the old rank 0 still listening on the port. A process that outlives its
  // SIGKILL (stuck in the kernel) holds the end back for kRankExitTimeout after the stop grace.
  if (task.lifecycle.ended() && !ProcessesGoneLocked(task)) {
    if (!task.exit_deadline) task.exit_deadline = now + options_.stop_grace + kRankExitTimeout;
    if (now < *task.exit_deadline) {
      status.set_state(v1::TASK_STATE_RUNNING);
      return status;
    }
    if (!task.exit_overdue_logged) {
      task.exit_overdue_logged = true;
      std::cerr << "tessera-worker: a rank of task " << task.task_id << " is still alive "
                << absl::FormatDuration(options_.stop_grace + kRankExitTimeout)
                << " after the task ended; reporting the end anyway" << std::endl;
    }
  }
  if (task.lifecycle.state() == v1::TASK_STATE_FAILED) *status.mutable_failure() = task.failure;
  for (const auto& rank : task.ranks) {
    if (rank.step_time) *status.add_ranks() = *rank.step_time;
  }
  return status;
}

absl::Status WorkerAgent::RegisterNow() {
  v1::RegisterNodeRequest request;
  request.set_node_id(options_.node_id);
  request.set_hostname(Hostname());
  request.set_address(advertise_address_);
  request.mutable_resources()->set_cpu_cores(static_cast<int>(std::thread::hardware_concurrency()));
  request.mutable_resources()->set_memory_bytes(static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) *
                                                sysconf(_SC_PAGE_SIZE));
  request.mutable_resources()->set_cpu_slots(options_.cpu_slots);
  for (const auto& device : devices_) *request.mutable_resources()->add_gpus() = device;
  for (const auto& [key, value] : options_.labels) (*request.mutable_labels())[key] = value;
  for (const auto& [level, domain] : options_.topology)
    (*request.mutable_topology())[level] = domain;
  request.set_worker_version(Version());
  {
    absl::MutexLock lock(&mu_);
    // Ended tasks too: one that ended while the coordinator was away is not lost.
    for (auto& [id, task] : tasks_) {
      *request.add_running_tasks() = TaskStatusLocked(task, clock_->Now());
    }
  }
  request.set_node_key(options_.node_key);
  v1::RegisterNodeResponse response;
  grpc::Status status = CallLeader([&](v1::NodeService::Stub& stub, grpc::ClientContext& context) {
    grpc::Status answer = stub.RegisterNode(&context, request, &response);
    if (!answer.ok()) return answer;
    return RefuseDeposedLeader(response.leader_epoch(), leader_->leader(), "");
  });
  absl::MutexLock lock(&mu_);
  LeaderAnsweredLocked(status.ok());
  if (!status.ok()) return FromGrpcStatus(status);
  registered_ = true;
  // Epochs start at 0 (SQLite state: always 0).
  leader_epoch_ = std::max(leader_epoch_.value_or(0), response.leader_epoch());
  if (response.heartbeat_interval_seconds() > 0) {
    heartbeat_interval_ = absl::Seconds(response.heartbeat_interval_seconds());
  }
  return absl::OkStatus();
}

void WorkerAgent::HeartbeatLoop() {
  absl::Duration wait = absl::ZeroDuration();
  std::string last_error;
  std::optional<bool> registration_told;
  while (WaitForHeartbeat(wait)) {
    bool registered;
    {
      absl::MutexLock lock(&mu_);
      registered = registered_;
      wait = heartbeat_interval_;
    }
    if (registration_observer_ && registration_told != registered) {
      registration_observer_(registered);
      registration_told = registered;
    }
    if (!registered) {
      if (auto status = RegisterNow(); !status.ok()) {
        if (status.ToString() != last_error) {
          std::cerr << "tessera-worker: cannot register with " << leader_->leader() << ": "
                    << status << " (retrying)" << std::endl;
          last_error = status.ToString();
        }
        wait = absl::Seconds(1);
      } else {
        std::cerr << "tessera-worker: registered with " << leader_->leader() << " as "
                  << options_.node_id << std::endl;
        if (watch_) watch_->Kick();
        last_error.clear();
        wait = absl::ZeroDuration();
      }
      continue;
    }
    v1::HeartbeatRequest request;
    request.set_node_id(options_.node_id);
    std::vector<std::string> terminal_sent;
    if (gpus_) {
      std::vector<GpuSample> samples = gpus_->Sample();
      if (gpu_observer_) gpu_observer_(devices_, samples);
      absl::MutexLock lock(&mu_);
      last_gpu_metrics_.clear();
      for (auto& sample : samples) last_gpu_metrics_.push_back(sample.metrics);
    }
    {
      absl::MutexLock lock(&mu_);
      for (const auto& metrics : last_gpu_metrics_) *request.add_gpu_metrics() = metrics;
      const absl::Time now = clock_->Now();
      for (auto& [id, task] : tasks_) {
        v1::TaskStatus* status = request.add_tasks();
        *status = TaskStatusLocked(task, now);
        if (IsTerminal(status->state())) terminal_sent.push_back(id);
      }
    }
    request.set_node_key(options_.node_key);
    v1::HeartbeatResponse response;
    grpc::Status status =
        CallLeader([&](v1::NodeService::Stub& stub, grpc::ClientContext& context) {
          grpc::Status answer = stub.Heartbeat(&context, request, &response);
          if (!answer.ok()) return answer;
          return RefuseDeposedLeader(response.leader_epoch(), leader_->leader(),
                                     DescribeLeaderOrders(response));
        });
    if (!status.ok()) {
      // The coordinator may be restarting (or another one taking over): keep the tasks and
      // reports, and register again once the leader answers.
      absl::MutexLock lock(&mu_);
      LeaderAnsweredLocked(false);
      registered_ = status.error_code() != grpc::StatusCode::UNAVAILABLE;
      wait = absl::Seconds(1);
      continue;
    }
    absl::MutexLock lock(&mu_);
    LeaderAnsweredLocked(true);
    // A newer leader took over (its epoch is above the one that registered us): its orders stand,
    // and it learns of the running tasks by a registration, as after a coordinator restart.
    if (leader_epoch_ && response.leader_epoch() > *leader_epoch_) {
      std::cerr << "tessera-worker: a new leader (epoch " << response.leader_epoch() << ", was "
                << *leader_epoch_ << ") answers at " << leader_->leader()
                << "; registering again with the running tasks" << std::endl;
      registered_ = false;
      wait = absl::ZeroDuration();
    }
    leader_epoch_ = std::max(leader_epoch_.value_or(0), response.leader_epoch());
    if (response.reregister()) {
      registered_ = false;
      wait = absl::ZeroDuration();
      continue;
    }
    for (const auto& id : terminal_sent) {
      if (auto it = tasks_.find(id); it != tasks_.end()) it->second.lifecycle.EndSent();
    }
    // Stops first: a start in the same answer may be held back by a task being stopped.
    for (const auto& id : response.stop()) {
      // The supervise loop decides STOPPED or FAILED, and stops the processes.
      if (auto it = tasks_.find(id); it != tasks_.end()) it->second.lifecycle.StopOrdered();
    }
    for (const auto& id : response.checkpoint_and_stop()) {
      auto it = tasks_.find(id);
      if (it == tasks_.end()) continue;
      Task& task = it->second;
      // The coordinator's deadline (a preemption's) where it sets one, else the worker's grace.
      absl::Duration grace = options_.checkpoint_grace;
      if (auto deadline = response.checkpoint_deadline_seconds().find(id);
          deadline != response.checkpoint_deadline_seconds().end() && deadline->second > 0) {
        grace = absl::Seconds(deadline->second);
      }
      // Only for a task neither stopping nor ended (an unlaunched one is simply stopped).
      if (!task.lifecycle.CheckpointOrdered(clock_->Now() + grace)) continue;
      SignalCheckpointLocked(task);
      std::cerr << "tessera-worker: task " << id << ": asked its ranks to save a checkpoint and "
                << "stop (up to " << grace << ")" << std::endl;
    }
    for (const auto& assignment : response.start()) LaunchLocked(assignment);
  }
}

void WorkerAgent::LaunchLocked(const v1::TaskAssignment& assignment) {
  // After Stop() has stopped the trainers, nothing new starts.
  if (stop_.HasBeenNotified()) return;
  if (tasks_.contains(assignment.task_id()) || assignment.trainers().empty()) return;
  Task& task = tasks_[assignment.task_id()];
  task.task_id = assignment.task_id();
  task.job_id = assignment.trainers(0).job_id();
  task.attempt = assignment.trainers(0).attempt();
  // The coordinator has moved on from an earlier attempt of the job still here (it restarted
  // since, and its stop order may come later): stop it.
  for (auto& [id, other] : tasks_) {
    if (other.job_id == task.job_id && other.attempt < task.attempt) other.lifecycle.StopOrdered();
  }
  if (const std::string holder = HeldBackByLocked(task, assignment); !holder.empty()) {
    std::cerr << "tessera-worker: task " << task.task_id << " starts once " << holder
              << " has stopped" << std::endl;
    task.deferred = assignment;
    return;
  }
  LaunchRanksLocked(task, assignment);
}

std::string WorkerAgent::HeldBackByLocked(const Task& task,
                                          const v1::TaskAssignment& assignment) const {
  for (const auto& [id, other] : tasks_) {
    if (&other == &task) continue;
    const bool same_job = other.job_id == task.job_id;
    if (!same_job && !other.lifecycle.on_its_way_out()) continue;
    for (const Rank& rank : other.ranks) {
      if (!rank.process || rank.exit) continue;
      if (same_job) return absl::StrCat("task ", id, " (another attempt of the job)");
      const v1::RankAssignment& held = rank.task.assignment();
      for (const v1::TrainerTask& trainer : assignment.trainers()) {
        const v1::RankAssignment& wanted = trainer.assignment();
        if (wanted.gpu_index() >= 0 && wanted.gpu_index() == rank.gpu) {
          return absl::StrCat("task ", id, " (on GPU ", rank.gpu, ")");
        }
        if (wanted.master_port() > 0 && wanted.master_port() == held.master_port() &&
            wanted.master_addr() == held.master_addr()) {
          return absl::StrCat("task ", id, " (master port ", held.master_port(), ")");
        }
      }
    }
  }
  return "";
}

void WorkerAgent::LaunchDeferredLocked() {
  for (auto& [id, task] : tasks_) {
    if (!task.deferred) continue;
    if (task.lifecycle.phase() == TaskPhase::kStopBeforeLaunch || stop_.HasBeenNotified()) {
      task.deferred.reset();
      task.lifecycle.Judged(v1::TASK_STATE_STOPPED);
      continue;
    }
    if (!HeldBackByLocked(task, *task.deferred).empty()) continue;
    const v1::TaskAssignment assignment = *std::move(task.deferred);
    task.deferred.reset();
    LaunchRanksLocked(task, assignment);
  }
}

void WorkerAgent::LaunchRanksLocked(Task& task, const v1::TaskAssignment& assignment) {
  const std::string dir =
      absl::StrCat(options_.work_dir, "/jobs/", task.job_id, "/attempt-", task.attempt);
  std::error_code ignored;
  std::filesystem::create_directories(dir, ignored);
  // A rank that cannot start fails the task, and the supervise loop stops the others.
  bool launch_failed = false;
  // Every rank of the job here: the rendezvous port is chosen here, on a socket handed to rank 0,
  // not the coordinator's, which another process on this machine (another cluster's trainer)
  // may hold. Several nodes: the coordinator's port, which every node's ranks were told.
  std::optional<RendezvousSocket> rendezvous;
  if (assignment.trainers_size() > 1 &&
      assignment.trainers(0).assignment().world_size() == assignment.trainers_size()) {
    absl::StatusOr<RendezvousSocket> bound =
        RendezvousSocket::Listen(assignment.trainers(0).assignment().master_addr());
    if (bound.ok()) {
      rendezvous.emplace(*std::move(bound));
      std::cerr << "tessera-worker: task " << task.task_id << " rendezvouses on port "
                << rendezvous->port() << ", chosen on this node" << std::endl;
    } else {
      std::cerr << "tessera-worker: task " << task.task_id << ": " << bound.status()
                << "; its rank 0 binds the coordinator's port "
                << assignment.trainers(0).assignment().master_port() << std::endl;
    }
  }
  for (const auto& trainer : assignment.trainers()) {
    Rank rank;
    rank.task = trainer;
    if (rendezvous) {
      rank.task.mutable_assignment()->set_master_port(rendezvous->port());
      if (trainer.assignment().rank() == 0) {
        rank.task.mutable_assignment()->set_master_listen_fd(kInheritedListenFd);
      }
    }
    const v1::RankAssignment& ra = rank.task.assignment();
    rank.gpu = ra.gpu_index();
    rank.task.set_report_socket(socket_path_);
    rank.task.set_shard_cache_socket(options_.shard_cache_socket);
    rank.task.set_heartbeat_interval_seconds(
        absl::ToDoubleSeconds(options_.trainer_heartbeat_interval));
    std::map<std::string, std::string> env = {
        {kRankEnv, std::to_string(ra.rank())},
        {kWorldSizeEnv, std::to_string(ra.world_size())},
        {kLocalRankEnv, std::to_string(ra.local_rank())},
        {kLocalWorldSizeEnv, std::to_string(ra.local_world_size())},
        {kMasterAddrEnv, ra.master_addr()},
        {kMasterPortEnv, std::to_string(ra.master_port())},
        {kCudaVisibleDevicesEnv, ra.gpu_index() >= 0 ? std::to_string(ra.gpu_index()) : ""},
        {kWorkerPidEnv, std::to_string(getpid())},
        {kOmpNumThreadsEnv, std::to_string(trainer_threads_)},
        {kMklNumThreadsEnv, std::to_string(trainer_threads_)}};
    // The process sees only its GPU, as device 0.
    if (ra.gpu_index() >= 0) rank.task.mutable_assignment()->set_gpu_index(0);
    std::string task_file = absl::StrCat(dir, "/rank-", ra.rank(), ".task.pb");
    rank.log_path = absl::StrCat(dir, "/rank-", ra.rank(), ".log");
    absl::Status status = WriteMessageFile(task_file, rank.task);
    if (status.ok()) {
      const bool hands_socket = ra.master_listen_fd() > 0 && rendezvous.has_value();
      auto process = options_.launcher->Launch(
          {.binary = options_.trainer_path,
           .args = {"--task=" + task_file},
           .env = env,
           .log_path = rank.log_path,
           .working_dir = dir,
           .inherited_fd = hands_socket ? rendezvous->fd() : -1,
           .inherited_fd_number = hands_socket ? ra.master_listen_fd() : kInheritedListenFd});
      if (process.ok()) {
        rank.process = std::move(*process);
        rank.launched = clock_->Now();
        // Without its record a successor worker could not find the trainer if this worker
        // died; the trainer's parent-death signal and socket watch still end it.
        if (absl::Status recorded =
                RecordTrainer(pid_dir_, rank.process->pid(), task.task_id, ra.rank());
            !recorded.ok()) {
          std::cerr << "tessera-worker: no pid file for rank " << ra.rank() << " of task "
                    << task.task_id << ": " << recorded << std::endl;
        }
      } else {
        status = process.status();
      }
    }
    if (!status.ok()) {
      launch_failed = true;
      task.failure.set_kind(v1::FAILURE_KIND_PROCESS_EXIT);
      task.failure.set_rank(ra.rank());
      task.failure.set_node_id(options_.node_id);
      task.failure.set_message(
          absl::StrCat("cannot start rank ", ra.rank(), ": ", status.message()));
      *task.failure.mutable_time() = ToTimestamp(clock_->Now());
    }
    task.ranks.push_back(std::move(rank));
  }
  if (launch_failed) {
    task.lifecycle.Judged(v1::TASK_STATE_FAILED);
  } else {
    task.lifecycle.Launched();
  }
}

void WorkerAgent::PollRankLocked(Rank& rank) {
  if (!rank.process || rank.exit) return;
  if (std::optional<ExitStatus> exit = rank.process->Poll()) RecordExitLocked(rank, *exit);
}

bool WorkerAgent::ProcessesGoneLocked(Task& task) {
  bool gone = true;
  for (Rank& rank : task.ranks) {
    PollRankLocked(rank);
    gone &= !rank.process || rank.exit.has_value();
  }
  return gone;
}

void WorkerAgent::RecordExitLocked(Rank& rank, ExitStatus exit) {
  if (rank.exit) return;
  rank.exit = exit;
  rank.exit_seen = clock_->Now();
  if (absl::Status status = RemovePidFile(pid_dir_, rank.process->pid()); !status.ok()) {
    // A stale file is harmless: its start time no longer matches any process.
    std::cerr << "tessera-worker: " << status << std::endl;
  }
}

v1::TrainerFailure WorkerAgent::ExitFailureLocked(const Rank& rank) {
  v1::TrainerFailure failure;
  if (rank.reported_failure) {
    failure = *rank.reported_failure;
  } else {
    failure.set_kind(v1::FAILURE_KIND_PROCESS_EXIT);
    failure.set_message(rank.exit->signal != 0
                            ? absl::StrCat("killed by signal ", rank.exit->signal)
                            : absl::StrCat("exited with code ", rank.exit->exit_code));
  }
  if (!failure.has_time()) *failure.mutable_time() = ToTimestamp(rank.exit_seen);
  failure.set_rank(rank.task.assignment().rank());
  failure.set_node_id(options_.node_id);
  failure.set_exit_code(std::max(0, rank.exit->exit_code));
  failure.set_signal(rank.exit->signal);
  return failure;
}

void WorkerAgent::JudgeTaskLocked(Task& task, absl::Time now) {
  std::vector<v1::TrainerFailure> failures;
  bool rank_running = false;
  for (const Rank& rank : task.ranks) {
    if (!rank.exit) {
      rank_running |= rank.process != nullptr;
    } else if (rank.exit->exit_code != 0) {
      // The process is gone but its socket may still hold its typed failure (the reader thread
      // has not reached the end of the stream): that report, not the bare exit code, tells a
      // lost peer from a cause. Also for a rank not heard from yet: one that fails at start
      // (missing data) sends its report and exits before the reader has read anything, and
      // blaming "exited with code 1" then lost the reason. A rank that never connects costs the
      // verdict kExitReportGrace.
      if (!rank.reported_failure && !rank.reports_ended &&
          now - rank.exit_seen < kExitReportGrace) {
        return;
      }
      failures.push_back(ExitFailureLocked(rank));
    }
  }
  if (!failures.empty()) {
    if (!task.first_failure_seen) task.first_failure_seen = now;
    // A rank that lost its peer fails first; hold on briefly for the rank that caused it. A
    // stop order does not wait: the coordinator already acts on a failure.
    const bool stop_ordered = task.lifecycle.phase() != TaskPhase::kRunning;
    if (stop_ordered || !AwaitCause(failures, rank_running, *task.first_failure_seen, now,
                                    options_.peer_failure_grace)) {
      task.lifecycle.Judged(v1::TASK_STATE_FAILED);
      task.failure = *BlameFailure(failures);
      for (const Rank& rank : task.ranks) {
        if (rank.task.assignment().rank() != task.failure.rank()) continue;
        task.failure.set_message(absl::StrCat(task.failure.message(), "; last lines of ",
                                              rank.log_path, ":\n",
                                              rank.process->LogTail(kFailureLogLines)));
      }
      return;
    }
  } else if (task.lifecycle.phase() != TaskPhase::kRunning) {
    // Asked for a checkpoint first: the ranks exit on their own once it is saved.
    const std::optional<absl::Time> checkpoint_deadline = task.lifecycle.checkpoint_deadline();
    const bool checkpointing = checkpoint_deadline && rank_running && now < *checkpoint_deadline;
    if (!checkpointing) {
      task.lifecycle.Judged(v1::TASK_STATE_STOPPED);
      return;
    }
  } else if (!rank_running) {
    task.lifecycle.Judged(v1::TASK_STATE_SUCCEEDED);
    return;
  }
  // The hang watchdog: a running rank silent for its job's hang timeout is frozen (stopped,
  // wedged in a driver), and its siblings wait on it in a collective forever.
  for (Rank& rank : task.ranks) {
    if (!rank.process || rank.exit) continue;
    const absl::Duration silence = Silence(rank.launched, rank.last_heartbeat, now);
    if (silence < HangTimeout(rank.task.spec())) continue;
    absl::StatusOr<ProcStat> stat = ReadProcStat(rank.process->pid());
    rank.hung = true;
    task.lifecycle.Judged(v1::TASK_STATE_FAILED);
    task.failure = HungRankFailure(rank.task.assignment().rank(), options_.node_id,
                                   rank.step_time ? rank.step_time->step() : 0, silence,
                                   stat.ok() ? stat->state : '?', now);
    task.failure.set_message(absl::StrCat(task.failure.message(), "; last lines of ", rank.log_path,
                                          ":\n", rank.process->LogTail(kFailureLogLines)));
    return;
  }
}

void WorkerAgent::SignalCheckpointLocked(Task& task) {
  for (Rank& rank : task.ranks) {
    if (!rank.process || rank.exit || rank.checkpoint_signalled) continue;
    // A rank not heard from yet may still be loading: the signal would kill it. The next
    // supervise poll signals it once it has reported.
    if (!rank.reporting && !rank.last_heartbeat) continue;
    rank.process->Signal(kCheckpointAndStopSignal);
    rank.checkpoint_signalled = true;
  }
}

void WorkerAgent::SuperviseLoop() {
  while (!WaitForStop(options_.poll_interval)) {
    std::vector<TrainerHandle*> to_kill;
    std::vector<TrainerHandle*> to_stop;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = clock_->Now();
      EnforceCoordinatorGraceLocked(now);
      for (auto& [id, task] : tasks_) {
        for (auto& rank : task.ranks) PollRankLocked(rank);
        if (task.lifecycle.phase() == TaskPhase::kCheckpointing) SignalCheckpointLocked(task);
        if (task.lifecycle.judging()) JudgeTaskLocked(task, now);
        if (task.lifecycle.ended()) {
          // A failed rank's siblings would hang in their next collective: stop them too. A hung
          // rank gets SIGKILL, which (unlike SIGTERM) reaches a stopped process.
          for (auto& rank : task.ranks) {
            if (!rank.process || rank.exit) continue;
            (rank.hung ? to_kill : to_stop).push_back(rank.process.get());
          }
        }
      }
      // After the polls above: a deferred task starts as soon as the exits it waits for are seen.
      LaunchDeferredLocked();
    }
    // Stopping waits for up to the grace period: outside the lock. Only this
    // thread erases tasks, so the processes stay alive meanwhile.
    for (TrainerHandle* process : to_kill) process->Kill();
    for (TrainerHandle* process : to_stop) process->Stop(options_.stop_grace);
    bool announce_end = false;
    {
      absl::MutexLock lock(&mu_);
      for (auto it = tasks_.begin(); it != tasks_.end();) {
        Task& task = it->second;
        const bool processes_gone = ProcessesGoneLocked(task);
        if (task.lifecycle.phase() == TaskPhase::kEndSent && task.unacked.empty() &&
            processes_gone) {
          it = tasks_.erase(it);
          continue;
        }
        // An end that can go out now goes in a heartbeat at once, not at the next interval: the
        // coordinator restarts or frees on it.
        if (processes_gone && task.unacked.empty() && task.lifecycle.EndReady()) {
          announce_end = true;
        }
        ++it;
      }
    }
    if (announce_end) WakeHeartbeat();
  }
}

WorkerAgent::Task* WorkerAgent::FindTaskLocked(const std::string& job_id, int attempt) {
  for (auto& [id, task] : tasks_) {
    if (task.job_id == job_id && task.attempt == attempt) return &task;
  }
  return nullptr;
}

absl::StatusOr<std::string> WorkerAgent::LogPath(const std::string& job_id, int attempt, int rank) {
  absl::MutexLock lock(&mu_);
  Task* task = FindTaskLocked(job_id, attempt);
  if (task != nullptr) {
    for (const auto& r : task->ranks) {
      if (r.task.assignment().rank() == rank) return r.log_path;
    }
  }
  // Finished tasks are forgotten, their logs are not.
  std::string path = absl::StrCat(options_.work_dir, "/jobs/", job_id, "/attempt-", attempt,
                                  "/rank-", rank, ".log");
  if (std::filesystem::exists(path)) return path;
  return absl::NotFoundError(absl::StrCat("no log of ", job_id, " attempt ", attempt, " rank ",
                                          rank, " on ", options_.node_id));
}

std::vector<int> WorkerAgent::Ranks(const std::string& job_id, int attempt, int rank) {
  std::vector<int> ranks;
  const std::string dir = absl::StrCat(options_.work_dir, "/jobs/", job_id, "/attempt-", attempt);
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    std::string name = entry.path().filename().string();
    int found = -1;
    if (sscanf(name.c_str(), "rank-%d.log", &found) == 1 && name.ends_with(".log") &&
        (rank < 0 || found == rank)) {
      ranks.push_back(found);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

bool WorkerAgent::Running(const std::string& job_id, int attempt) {
  absl::MutexLock lock(&mu_);
  Task* task = FindTaskLocked(job_id, attempt);
  return task != nullptr && !task->lifecycle.ended();
}

std::vector<RunningRank> WorkerAgent::RunningRanks() {
  std::map<int, std::string> uuids;
  for (const auto& device : devices_) uuids[device.index()] = device.uuid();
  std::vector<RunningRank> running;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, task] : tasks_) {
    if (task.lifecycle.ended()) continue;
    for (const Rank& rank : task.ranks) {
      if (rank.exit) continue;
      const auto uuid = uuids.find(rank.gpu);
      running.push_back({.job_id = task.job_id,
                         .rank = rank.task.assignment().rank(),
                         .gpu = rank.gpu,
                         .gpu_uuid = uuid != uuids.end() ? uuid->second : ""});
    }
  }
  return running;
}

v1::Node WorkerAgent::NodeView() {
  v1::Node node;
  node.set_node_id(options_.node_id);
  node.set_hostname(Hostname());
  node.set_address(advertise_address_);
  node.set_worker_version(Version());
  node.mutable_resources()->set_cpu_slots(options_.cpu_slots);
  for (const auto& device : devices_) *node.mutable_resources()->add_gpus() = device;
  absl::MutexLock lock(&mu_);
  node.set_state(registered_ ? v1::NODE_STATE_READY : v1::NODE_STATE_UNSPECIFIED);
  for (const auto& metrics : last_gpu_metrics_) *node.add_gpu_metrics() = metrics;
  for (const auto& [id, task] : tasks_) node.add_job_ids(task.job_id);
  return node;
}

}  // namespace tessera::worker
