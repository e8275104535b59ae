// Test-only fakes for WorkerAgent's tests (worker_agent_test.cc with real trainer processes,
// worker_agent_sim_test.cc in-process on a simulated clock): a coordinator's NodeService that
// hands out one task and records what the worker says, and the assignments it hands out. It may
// also stand by (every call UNAVAILABLE, naming the leader in `tessera-leader` as the HA contract
// says) and answer with a leader epoch.
//
// Thread safety: FakeCoordinator's methods may be called from any thread (gRPC's and the test's);
// one absl::Mutex guards what it records.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/daemon/leader_channel.h"
#include "grpcpp/server_builder.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::worker::agent_test {

inline constexpr char kTaskId[] = "job-1/0/n1";

inline bool IsTerminal(v1::TaskState state) {
  return state == v1::TASK_STATE_SUCCEEDED || state == v1::TASK_STATE_FAILED ||
         state == v1::TASK_STATE_STOPPED;
}

inline int CountFiles(const std::string& dir) {
  int files = 0;
  std::error_code error;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    ++files;
  }
  return files;
}

// Hands out one task at the first heartbeat, records what the worker sends (each heartbeat with
// the time on `clock` it arrived), and acknowledges every report.
class FakeCoordinator final : public v1::NodeService::Service {
 public:
  explicit FakeCoordinator(v1::TaskAssignment assignment, Clock* clock = Clock::Real())
      : assignment_(std::move(assignment)), clock_(clock) {}

  // The heartbeat interval registration answers with (0.1 s unless set).
  void set_heartbeat_interval_seconds(double seconds) {
    absl::MutexLock lock(&mu_);
    heartbeat_interval_seconds_ = seconds;
  }

  // Answer heartbeats with a stop order for the task once a failure report arrived.
  void StopOnFailureReport() {
    absl::MutexLock lock(&mu_);
    stop_on_failure_report_ = true;
  }

  // The leader epoch every answer carries (0 unless set).
  void set_leader_epoch(int64_t epoch) {
    absl::MutexLock lock(&mu_);
    leader_epoch_ = epoch;
  }
  // Stands by: every call fails UNAVAILABLE, with `leader` in the trailing metadata unless empty
  // (no leader elected yet). Lead() answers again.
  void StandBy(std::string leader) {
    absl::MutexLock lock(&mu_);
    standby_ = true;
    leader_ = std::move(leader);
  }
  void Lead() {
    absl::MutexLock lock(&mu_);
    standby_ = false;
  }
  std::vector<v1::RegisterNodeRequest> registrations() {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }

  grpc::Status RegisterNode(grpc::ServerContext* context, const v1::RegisterNodeRequest* request,
                            v1::RegisterNodeResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (standby_) return StandbyLocked(context);
    registrations_.push_back(*request);
    response->set_heartbeat_interval_seconds(heartbeat_interval_seconds_);
    response->set_leader_epoch(leader_epoch_);
    return grpc::Status::OK;
  }

  // Answers the heartbeats after the first (which carries the assignment) too, under the lock.
  using Hook = std::function<void(const v1::HeartbeatRequest&, v1::HeartbeatResponse*)>;
  void OnHeartbeat(Hook hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }

  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (standby_) return StandbyLocked(context);
    response->set_leader_epoch(leader_epoch_);
    if (!assigned_) {
      *response->add_start() = assignment_;
      assigned_ = true;
    } else if (hook_) {
      hook_(*request, response);
    }
    heartbeats_.push_back({*request, *response, clock_->Now()});
    for (const v1::TaskStatus& status : request->tasks()) {
      if (status.task_id() != kTaskId) continue;
      if (!IsTerminal(last_status_.state()) && IsTerminal(status.state())) {
        trainers_at_end_ = CountFiles(trainers_dir_);
      }
      if (!IsTerminal(last_status_.state())) last_status_ = status;
      for (const v1::RankStepTime& rank : status.ranks()) step_times_.push_back(rank);
    }
    if (stop_on_failure_report_ && failure_reported_) response->add_stop(kTaskId);
    return grpc::Status::OK;
  }

  grpc::Status Report(grpc::ServerContext* context, const v1::ReportRequest* request,
                      v1::ReportResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (standby_) return StandbyLocked(context);
    const int64_t expected = first_unseen_;
    for (int i = 0; i < request->reports_size(); ++i) {
      if (request->first_sequence() + i < expected) continue;  // a resend
      relayed_.push_back(request->reports(i));
      failure_reported_ |= request->reports(i).has_failure();
      ++first_unseen_;
    }
    response->set_acked_sequence(first_unseen_ - 1);
    return grpc::Status::OK;
  }

  // The task's first terminal status (waiting up to `timeout`), or the last one seen.
  v1::TaskStatus WaitForEnd(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return IsTerminal(last_status_.state());
    };
    mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
    return last_status_;
  }
  // The task's first terminal status, or the last one seen; no wait.
  v1::TaskStatus last_status() {
    absl::MutexLock lock(&mu_);
    return last_status_;
  }
  std::vector<v1::TrainerReport> relayed() {
    absl::MutexLock lock(&mu_);
    return relayed_;
  }
  std::vector<v1::RankStepTime> step_times() {
    absl::MutexLock lock(&mu_);
    return step_times_;
  }
  struct Exchange {
    v1::HeartbeatRequest request;
    v1::HeartbeatResponse response;
    // When the heartbeat arrived, on the coordinator's clock.
    absl::Time at;
  };
  std::vector<Exchange> heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  // Waits up to `timeout` for `done` to hold for the heartbeats so far; returns them.
  std::vector<Exchange> WaitForHeartbeats(std::function<bool(const std::vector<Exchange>&)> done,
                                          absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done(heartbeats_); };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    return heartbeats_;
  }
  // Where the worker keeps a pid file per live trainer.
  void set_trainers_dir(std::string dir) {
    absl::MutexLock lock(&mu_);
    trainers_dir_ = std::move(dir);
  }
  // Pid files there when the first terminal status arrived; -1 before one did.
  int trainers_at_end() {
    absl::MutexLock lock(&mu_);
    return trainers_at_end_;
  }

 private:
  grpc::Status StandbyLocked(grpc::ServerContext* context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!leader_.empty()) context->AddTrailingMetadata(kLeaderMetadataKey, leader_);
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        leader_.empty() ? "a standby; no leader is elected yet"
                                        : "a standby; the leader is at " + leader_);
  }

  const v1::TaskAssignment assignment_;
  Clock* const clock_;
  absl::Mutex mu_;
  double heartbeat_interval_seconds_ ABSL_GUARDED_BY(mu_) = 0.1;
  bool assigned_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_on_failure_report_ ABSL_GUARDED_BY(mu_) = false;
  bool failure_reported_ ABSL_GUARDED_BY(mu_) = false;
  v1::TaskStatus last_status_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::RankStepTime> step_times_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::TrainerReport> relayed_ ABSL_GUARDED_BY(mu_);
  int64_t first_unseen_ ABSL_GUARDED_BY(mu_) = 1;
  std::string trainers_dir_ ABSL_GUARDED_BY(mu_);
  int trainers_at_end_ ABSL_GUARDED_BY(mu_) = -1;
  Hook hook_ ABSL_GUARDED_BY(mu_);
  std::vector<Exchange> heartbeats_ ABSL_GUARDED_BY(mu_);
  int64_t leader_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool standby_ ABSL_GUARDED_BY(mu_) = false;
  std::string leader_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::RegisterNodeRequest> registrations_ ABSL_GUARDED_BY(mu_);
};

// Two CPU ranks of job-1 attempt 0, with the fake's flags per rank.
inline v1::TaskAssignment TwoRanks(int hang_timeout_seconds) {
  v1::TaskAssignment assignment;
  assignment.set_task_id(kTaskId);
  for (int rank = 0; rank < 2; ++rank) {
    v1::TrainerTask* trainer = assignment.add_trainers();
    trainer->set_job_id("job-1");
    trainer->set_attempt(0);
    trainer->mutable_spec()->set_hang_timeout_seconds(hang_timeout_seconds);
    v1::RankAssignment* ra = trainer->mutable_assignment();
    ra->set_rank(rank);
    ra->set_world_size(2);
    ra->set_local_rank(rank);
    ra->set_local_world_size(2);
    ra->set_master_addr("127.0.0.1");
    ra->set_master_port(29500);
    ra->set_device_type(v1::DEVICE_TYPE_CPU);
    ra->set_gpu_index(-1);
  }
  return assignment;
}

// Two ranks of `job_id`'s `attempt` on GPUs `gpu` and `gpu` + 1, their rendezvous on `port`.
inline v1::TaskAssignment GpuRanks(const std::string& job_id, int attempt, int gpu, int port) {
  v1::TaskAssignment assignment = TwoRanks(0);
  assignment.set_task_id(absl::StrCat(job_id, "/", attempt, "/n1"));
  for (int rank = 0; rank < 2; ++rank) {
    v1::TrainerTask* trainer = assignment.mutable_trainers(rank);
    trainer->set_job_id(job_id);
    trainer->set_attempt(attempt);
    v1::RankAssignment* ra = trainer->mutable_assignment();
    ra->set_master_port(port);
    ra->set_device_type(v1::DEVICE_TYPE_CUDA);
    ra->set_gpu_index(gpu + rank);
  }
  return assignment;
}

// The state of `task_id` in a heartbeat; UNSPECIFIED when it is not listed.
inline v1::TaskState StateIn(const v1::HeartbeatRequest& request, const std::string& task_id) {
  for (const v1::TaskStatus& status : request.tasks()) {
    if (status.task_id() == task_id) return status.state();
  }
  return v1::TASK_STATE_UNSPECIFIED;
}

// Serves `coordinator` on 127.0.0.1 at a free port; sets `*address` to "127.0.0.1:<port>". Null
// when the server cannot start.
inline std::unique_ptr<grpc::Server> ServeOnLoopback(FakeCoordinator* coordinator,
                                                     std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(coordinator);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

}  // namespace tessera::worker::agent_test
