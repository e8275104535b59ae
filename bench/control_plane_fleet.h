// SimulatedFleet: many worker nodes in one process, speaking the real
// tessera.v1.NodeService protocol to a coordinator. Each node registers with
// its GPUs, heartbeats on a fixed period (the fleet's heartbeats are spread
// evenly over the period), takes the assignments that come back, reports its
// tasks RUNNING on the next heartbeat and SUCCEEDED after a simulated run
// time, and relays what a rank-0 trainer would report (started, a few step
// metrics) through NodeService.Report. With watch_assignments, like a real
// worker (--watch_assignments), each registered node keeps a
// NodeService.WatchAssignments stream open and heartbeats at once when a notice
// comes, so work starts without waiting for the node's next heartbeat slot.
// Like a worker, it sends a heartbeat at once when a task ends
// (announce_ends), so the coordinator frees the devices without waiting for
// the node's next slot. Between the heartbeats, from the same thread and on
// the same connections, it samples the standard grpc.health.v1.Health/Check
// as a no-op baseline.
//
// Unlike the daemons' clients, it uses gRPC's callback client API: one
// thread cannot drive ten thousand nodes' sync calls once a second.
//
// Thread safety: Start/WaitRegistered/Stop from one thread. Pacing runs on
// two threads of the fleet (registration; heartbeats with the health checks
// between them); RPC completions run on gRPC's threads. Each node's state
// has its own mutex; recorders and counters are thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <queue>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "bench/control_plane_stats.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::bench {

struct FleetOptions {
  int nodes = 100;
  int gpus_per_node = 8;
  std::string gpu_name = "NVIDIA H100 80GB HBM3";
  int64_t gpu_memory_bytes = int64_t{80} << 30;
  // Node ids are <prefix><index>.
  std::string node_prefix = "sim-node-";
  // Period of each node's heartbeat.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // Separate HTTP/2 connections the nodes are spread over.
  int channels = 8;
  // Deadline of every call.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // A task runs for a time in [min_run_time, max_run_time], the same for
  // every node of a job.
  absl::Duration min_run_time = absl::Seconds(2);
  absl::Duration max_run_time = absl::Seconds(5);
  // Registrations in flight at once while the fleet joins.
  int register_concurrency = 64;
  // Health/Check calls per second (the baseline), interleaved with the
  // heartbeats; at most one per heartbeat. 0 disables them.
  double health_checks_per_second = 20;
  // Step metrics rank 0 reports before its task finishes; 0 sends none.
  int metric_steps_per_job = 10;
  // Each registered node watches for assignments (NodeService.WatchAssignments) and heartbeats
  // when notified, as workers do by default; false: orders wait for the next heartbeat slot.
  bool watch_assignments = false;
  // Deadline of each watch stream.
  absl::Duration watch_lifetime = absl::Hours(1);
  // A task's end goes out in a heartbeat at once, as workers send it (after rank 0's last
  // report has landed); false: at the node's next heartbeat slot, the fleet's behaviour before
  // 2026-11-28, which held every job's devices up to two periods longer than it ran.
  bool announce_ends = true;
};

// Called (on a gRPC thread, with no fleet lock held) when `ranks` ranks of
// a job reach a node; `world_size` is the job's total.
using DeliveryObserver =
    std::function<void(const std::string& job_id, int ranks, int world_size, Clock::time_point)>;

// Running totals since Start().
struct FleetCounters {
  int64_t registered = 0;
  int64_t register_failures = 0;
  int64_t heartbeats_ok = 0;
  int64_t heartbeat_failures = 0;
  // Slots at which the node's previous heartbeat was still in flight.
  int64_t heartbeats_skipped = 0;
  // Slots skipped because the node had sent a heartbeat out of its slot (a notice, a task's end)
  // less than a period before, and the heartbeats sent instead a period after that one.
  int64_t slots_covered = 0;
  int64_t timer_heartbeats = 0;
  // Heartbeat answers that asked the node to register again.
  int64_t reregister_requests = 0;
  int64_t tasks_started = 0;
  int64_t tasks_succeeded = 0;
  int64_t stop_orders = 0;
  int64_t reports_ok = 0;
  int64_t report_failures = 0;
  int64_t health_failures = 0;
  // Pacer rounds restarted because the heartbeat thread fell a whole period
  // behind (the load generator itself could not keep up).
  int64_t pacer_resets = 0;
  // WatchAssignments: streams opened, notices received, heartbeats sent out of the node's slot
  // (on a notice, or for a task's end), and streams that ended with an error before Stop().
  int64_t watches_opened = 0;
  int64_t notices = 0;
  int64_t notified_heartbeats = 0;
  int64_t watch_failures = 0;
  // Task ends that asked for a heartbeat at once (announce_ends).
  int64_t end_announcements = 0;
  // The first error message seen, for the summary.
  std::string first_error;
};

class SimulatedFleet {
 public:
  // `address` is the coordinator's host:port; `on_delivery` may be null.
  SimulatedFleet(const std::string& address, FleetOptions options, DeliveryObserver on_delivery);
  // Stops (see Stop()).
  ~SimulatedFleet();
  SimulatedFleet(const SimulatedFleet&) = delete;
  SimulatedFleet& operator=(const SimulatedFleet&) = delete;

  // Registers the nodes (register_concurrency at a time) and starts the
  // heartbeats, which each node begins once registered, and the health
  // checks.
  void Start();
  // Waits until every node has registered or `timeout` passes; returns how
  // many have.
  int WaitRegistered(absl::Duration timeout);
  // Stops sending and waits for the calls in flight (each ends by its
  // deadline). Idempotent.
  void Stop();

  // Client-side durations; each sample is stamped with its completion.
  const LatencyRecorder& heartbeat_latency() const { return heartbeat_latency_; }
  const LatencyRecorder& health_latency() const { return health_latency_; }
  const LatencyRecorder& register_latency() const { return register_latency_; }
  const LatencyRecorder& report_latency() const { return report_latency_; }
  FleetCounters counters() const;

 private:
  struct Connection {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::NodeService::Stub> nodes;
    std::unique_ptr<grpc::health::v1::Health::Stub> health;
  };
  struct Task {
    std::string job_id;
    int32_t attempt = 0;
    v1::TaskState state = v1::TASK_STATE_RUNNING;
    Clock::time_point finish_at;
    bool holds_rank0 = false;
    // Sequence number of the next report relayed for the task.
    int64_t next_sequence = 1;
    // Rank 0's final metrics are in flight; the task succeeds when they land.
    bool finishing = false;
  };
  class Watch;
  struct Node {
    std::string id;
    Connection* connection = nullptr;
    v1::RegisterNodeRequest registration;
    absl::Mutex mu;
    bool registered ABSL_GUARDED_BY(mu) = false;
    // Owned by the registration loop, or a RegisterNode call in flight;
    // true from the start so the pacer leaves joining nodes to the loop.
    bool registering ABSL_GUARDED_BY(mu) = true;
    bool heartbeat_in_flight ABSL_GUARDED_BY(mu) = false;
    // When the last heartbeat out of the node's slot was sent.
    Clock::time_point last_out_of_slot ABSL_GUARDED_BY(mu);
    std::map<std::string, Task> tasks ABSL_GUARDED_BY(mu);
    // A notice came while a heartbeat was in flight: heartbeat again when it returns.
    bool beat_requested ABSL_GUARDED_BY(mu) = false;
    // The open WatchAssignments stream, if any.
    std::shared_ptr<Watch> watch ABSL_GUARDED_BY(mu);
  };

  void RegistrationLoop();
  void HeartbeatLoop();
  // Registers the node if it must, else sends its heartbeat unless the
  // previous one is still in flight. At the node's slot (`at_slot`), a node
  // that sent one out of its slot less than a period ago skips it, as a
  // worker's interval restarts at every heartbeat.
  void Beat(Node& node, bool at_slot);
  // The node's heartbeat: every task's state, finishing those whose run
  // time is over; rank 0's final metric reports, to send first, go to
  // `final_reports` as (task_id, request).
  v1::HeartbeatRequest HeartbeatLocked(
      Node& node, std::vector<std::pair<std::string, v1::ReportRequest>>* final_reports)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(node.mu);
  void SendRegister(Node& node);
  // Opens the node's WatchAssignments stream unless one is open.
  void OpenWatch(Node& node);
  // A notice: heartbeat now, or as soon as the one in flight returns.
  void OnNotice(Node& node);
  // Heartbeats now, or as soon as the one in flight returns; `counter` counts the heartbeats
  // sent now. Nothing for a node not registered.
  void BeatSoon(Node& node, std::atomic<int64_t>* counter);
  // With announce_ends: the node heartbeats once `at` has passed, when a task's run is over.
  void AnnounceEndAt(Node& node, Clock::time_point at);
  // On the heartbeat thread: announces the ends that have come due, and sends the heartbeats
  // due a period after one out of the node's slot (a worker's interval restarts at every
  // heartbeat, so its next comes a period later, whatever its slot).
  void BeatWhatIsDue(Clock::time_point now);
  // One grpc.health.v1.Health/Check on `connection`, timed like a heartbeat.
  void CheckHealth(Connection& connection);
  void OnHeartbeatDone(Node& node, const v1::HeartbeatRequest& request,
                       const v1::HeartbeatResponse& response, const grpc::Status& status,
                       Clock::time_point sent);
  void SendReport(Node& node, const std::string& task_id, v1::ReportRequest request,
                  bool finishes_task);
  std::unique_ptr<grpc::ClientContext> NewContext() const;
  absl::Duration RunTime(const std::string& job_id) const;
  void NoteError(const std::string& what, const grpc::Status& status);
  // Every RPC issued is bracketed by these; Stop() waits for the count to
  // drain. CallDone must be the last thing a completion touches.
  void CallStarted() { calls_in_flight_.fetch_add(1, std::memory_order_relaxed); }
  void CallDone() { calls_in_flight_.fetch_sub(1, std::memory_order_release); }

  const FleetOptions options_;
  const DeliveryObserver on_delivery_;
  std::vector<Connection> connections_;
  std::vector<std::unique_ptr<Node>> nodes_;
  v1::HeartbeatRequest gpu_metrics_template_;

  LatencyRecorder heartbeat_latency_;
  LatencyRecorder health_latency_;
  LatencyRecorder register_latency_;
  LatencyRecorder report_latency_;

  std::atomic<int64_t> calls_in_flight_{0};
  std::atomic<int64_t> registers_in_flight_{0};
  std::atomic<int64_t> health_checks_in_flight_{0};
  std::atomic<int64_t> registered_{0};
  std::atomic<int64_t> register_failures_{0};
  std::atomic<int64_t> heartbeats_ok_{0};
  std::atomic<int64_t> heartbeat_failures_{0};
  std::atomic<int64_t> heartbeats_skipped_{0};
  std::atomic<int64_t> slots_covered_{0};
  std::atomic<int64_t> reregister_requests_{0};
  std::atomic<int64_t> tasks_started_{0};
  std::atomic<int64_t> tasks_succeeded_{0};
  std::atomic<int64_t> stop_orders_{0};
  std::atomic<int64_t> reports_ok_{0};
  std::atomic<int64_t> report_failures_{0};
  std::atomic<int64_t> health_failures_{0};
  std::atomic<int64_t> pacer_resets_{0};
  std::atomic<int64_t> watches_opened_{0};
  std::atomic<int64_t> notices_{0};
  std::atomic<int64_t> notified_heartbeats_{0};
  std::atomic<int64_t> watch_failures_{0};
  std::atomic<int64_t> end_announcements_{0};
  // Heartbeats due out of the nodes' slots, soonest first.
  struct Due {
    Clock::time_point at;
    Node* node;
    // True: a task's end to announce. False: the heartbeat a period after the one out of slot
    // sent at `after`; it lapses if the node has sent another out of slot since.
    bool end;
    Clock::time_point after;
    bool operator>(const Due& other) const { return at > other.at; }
  };
  std::atomic<int64_t> timer_heartbeats_{0};
  absl::Mutex due_mu_;
  std::priority_queue<Due, std::vector<Due>, std::greater<>> due_ ABSL_GUARDED_BY(due_mu_);
  mutable absl::Mutex error_mu_;
  std::string first_error_ ABSL_GUARDED_BY(error_mu_);

  absl::Notification stop_;
  std::vector<std::thread> threads_;
};

}  // namespace tessera::bench
