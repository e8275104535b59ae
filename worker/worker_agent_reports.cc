// WorkerAgent's report path: the trainers' report socket (one reader thread per connection),
// which keeps rank heartbeats and rank step reports to the agent and queues the other reports, and
// the relay loop that sends the queued reports to the coordinator in batches. The supervision,
// launching and heartbeating live in worker_agent.cc.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <thread>
#include <vector>

#include "google/protobuf/io/zero_copy_stream_impl.h"
#include "grpcpp/client_context.h"
#include "worker/failure_policy.h"
#include "worker/report_stream.h"
#include "worker/worker_agent.h"

namespace tessera::worker {
namespace {

// Most reports relayed in one Report call.
constexpr int kRelayBatch = 256;

}  // namespace

void WorkerAgent::AcceptLoop() {
  std::vector<std::thread> readers;
  while (!stop_.HasBeenNotified()) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 200) <= 0) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    readers.emplace_back([this, fd] { ReadReports(fd); });
  }
  for (auto& reader : readers) reader.join();
}

void WorkerAgent::ReadReports(int fd) {
  {
    absl::MutexLock lock(&mu_);
    reader_fds_.insert(fd);
    if (stop_.HasBeenNotified()) shutdown(fd, SHUT_RDWR);
  }
  {
    // Blocking reads; Stop() shuts the socket down to end them.
    google::protobuf::io::FileInputStream stream(fd);
    // The connection's rank, once a report named it: its end of stream tells the supervise
    // loop that no typed failure report of that rank is still on its way.
    std::optional<v1::TrainerReport> sender;
    while (true) {
      v1::TrainerReport report;
      // The trainer closed its end, or wrote a malformed frame: either way the stream is done.
      if (!ReadTrainerReport(&stream, &report).ok()) break;
      if (report_observer_) report_observer_(report);
      absl::MutexLock lock(&mu_);
      Task* task = FindTaskLocked(report.job_id(), report.attempt());
      if (task == nullptr) continue;
      if (!sender) {
        sender.emplace();
        sender->set_job_id(report.job_id());
        sender->set_attempt(report.attempt());
        sender->set_rank(report.rank());
      }
      if (report.has_heartbeat()) {
        // Consumed here (hang watchdog, node heartbeat), never relayed: one per rank per
        // interval would swamp the report queue and the coordinator's log.
        for (auto& rank : task->ranks) {
          if (rank.task.assignment().rank() != report.rank()) continue;
          rank.reporting = true;
          rank.last_heartbeat = clock_->Now();
          v1::RankStepTime& step_time = rank.step_time.emplace();
          step_time.set_rank(report.rank());
          step_time.set_node_id(options_.node_id);
          step_time.set_step(report.heartbeat().step());
          step_time.set_step_seconds(report.heartbeat().step_seconds());
          step_time.set_busy_seconds(report.heartbeat().busy_seconds());
          if (report.heartbeat().has_breakdown()) {
            *step_time.mutable_breakdown() = report.heartbeat().breakdown();
          }
          *step_time.mutable_heartbeat_time() = ToTimestamp(*rank.last_heartbeat);
        }
        continue;
      }
      // Every rank's per-step figures feed the worker's metrics (the observer above) and reach
      // the coordinator as the heartbeat's mean breakdown; relayed one per rank per step they
      // would swamp the report queue as heartbeats would.
      if (report.has_rank_step()) continue;
      if (report.has_failure()) {
        for (auto& rank : task->ranks) {
          if (rank.task.assignment().rank() == report.rank()) {
            rank.reporting = true;
            rank.reported_failure = report.failure();
          }
        }
      }
      task->unacked.push_back(std::move(report));
      ++task->next_sequence;
    }
    absl::MutexLock lock(&mu_);
    Task* task = sender ? FindTaskLocked(sender->job_id(), sender->attempt()) : nullptr;
    if (task != nullptr) {
      for (auto& rank : task->ranks) {
        if (rank.task.assignment().rank() == sender->rank()) rank.reports_ended = true;
      }
    }
  }
  absl::MutexLock lock(&mu_);
  reader_fds_.erase(fd);
  close(fd);
}

void WorkerAgent::RelayLoop() {
  while (!WaitForStop(options_.poll_interval)) {
    std::vector<v1::ReportRequest> batches;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [id, task] : tasks_) {
        if (task.unacked.empty()) continue;
        v1::ReportRequest& request = batches.emplace_back();
        request.set_node_id(options_.node_id);
        request.set_task_id(id);
        request.set_node_key(options_.node_key);
        request.set_first_sequence(task.first_unacked);
        int count = std::min<int>(kRelayBatch, static_cast<int>(task.unacked.size()));
        for (int i = 0; i < count; ++i) *request.add_reports() = task.unacked[i];
      }
    }
    for (const auto& request : batches) {
      v1::ReportResponse response;
      // Unreachable coordinator: the reports stay queued for the next round.
      if (!CallLeader([&](v1::NodeService::Stub& stub, grpc::ClientContext& context) {
             return stub.Report(&context, request, &response);
           }).ok()) {
        break;
      }
      absl::MutexLock lock(&mu_);
      auto it = tasks_.find(request.task_id());
      if (it == tasks_.end()) continue;
      Task& task = it->second;
      int64_t acked = response.acked_sequence() - task.first_unacked + 1;
      acked = std::clamp<int64_t>(acked, 0, static_cast<int64_t>(task.unacked.size()));
      task.unacked.erase(task.unacked.begin(), task.unacked.begin() + acked);
      task.first_unacked += acked;
    }
  }
}

}  // namespace tessera::worker
