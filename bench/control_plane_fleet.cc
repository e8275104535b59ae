#include "bench/control_plane_fleet.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace tessera::bench {
namespace {

// Channel argument that differs per connection: gRPC shares one subchannel
// (one TCP connection) between channels whose arguments are all equal.
constexpr char kConnectionIndexArg[] = "tessera.bench.connection_index";
// How often the heartbeat pacer wakes to send what has come due.
constexpr absl::Duration kPacerTick = absl::Milliseconds(1);
// A node's slot is skipped when it heartbeated out of its slot within this share of a period
// (a worker's next heartbeat comes a whole period after its last; the margin keeps a slot that
// is merely late from being skipped).
constexpr double kSlotCoveredWithin = 0.9;
// Health checks allowed in flight before the sampler skips one.
constexpr int64_t kMaxHealthChecksInFlight = 256;
// Parameters of GPT-2 124M, as a rank-0 trainer would report them.
constexpr int64_t kReportedParameters = 124'439'808;

bool IsTerminal(v1::TaskState state) {
  return state == v1::TASK_STATE_SUCCEEDED || state == v1::TASK_STATE_FAILED ||
         state == v1::TASK_STATE_STOPPED;
}

v1::TaskStatus StatusOf(const std::string& task_id, const std::string& job_id, int32_t attempt,
                        v1::TaskState state) {
  v1::TaskStatus status;
  status.set_task_id(task_id);
  status.set_job_id(job_id);
  status.set_attempt(attempt);
  status.set_state(state);
  return status;
}

}  // namespace

// One node's WatchAssignments stream (gRPC's callback API: ten thousand streams need no thread
// each). Owned by the node while open and by itself until OnDone.
class SimulatedFleet::Watch : public grpc::ClientReadReactor<v1::AssignmentsNotice> {
 public:
  Watch(SimulatedFleet* fleet, Node* node) : fleet_(fleet), node_(node) {}

  void Start(std::shared_ptr<Watch> self) {
    self_ = std::move(self);
    request_.set_node_id(node_->id);
    context_.set_deadline(absl::ToChronoTime(absl::Now() + fleet_->options_.watch_lifetime));
    fleet_->CallStarted();
    fleet_->watches_opened_.fetch_add(1);
    node_->connection->nodes->async()->WatchAssignments(&context_, &request_, this);
    StartRead(&notice_);
    StartCall();
  }
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    fleet_->notices_.fetch_add(1);
    fleet_->OnNotice(*node_);
    StartRead(&notice_);
  }
  void OnDone(const grpc::Status& status) override {
    if (!status.ok() && !fleet_->stop_.HasBeenNotified()) {
      fleet_->watch_failures_.fetch_add(1);
      fleet_->NoteError("WatchAssignments", status);
    }
    {
      absl::MutexLock lock(&node_->mu);
      if (node_->watch.get() == this) node_->watch.reset();
    }
    SimulatedFleet* fleet = fleet_;
    std::shared_ptr<Watch> self = std::move(self_);
    self.reset();  // may delete this
    fleet->CallDone();
  }

 private:
  SimulatedFleet* const fleet_;
  Node* const node_;
  grpc::ClientContext context_;
  v1::WatchAssignmentsRequest request_;
  v1::AssignmentsNotice notice_;
  std::shared_ptr<Watch> self_;
};

SimulatedFleet::SimulatedFleet(const std::string& address, FleetOptions options,
                               DeliveryObserver on_delivery)
    : options_(std::move(options)), on_delivery_(std::move(on_delivery)) {
  const int channels = std::max(1, options_.channels);
  connections_.resize(channels);
  for (int i = 0; i < channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(kConnectionIndexArg, i);
    Connection& connection = connections_[i];
    connection.channel =
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    connection.nodes = v1::NodeService::NewStub(connection.channel);
    connection.health = grpc::health::v1::Health::NewStub(connection.channel);
  }
  for (int g = 0; g < options_.gpus_per_node; ++g) {
    v1::GpuMetrics* metrics = gpu_metrics_template_.add_gpu_metrics();
    metrics->set_index(g);
    metrics->set_utilization_percent(97);
    metrics->set_memory_utilization_percent(61);
    metrics->set_memory_used_bytes(options_.gpu_memory_bytes * 7 / 8);
    metrics->set_memory_total_bytes(options_.gpu_memory_bytes);
    metrics->set_power_watts(650);
    metrics->set_temperature_celsius(63);
    metrics->set_sm_clock_mhz(1980);
  }
  nodes_.reserve(options_.nodes);
  for (int i = 0; i < options_.nodes; ++i) {
    auto node = std::make_unique<Node>();
    node->id = absl::StrCat(options_.node_prefix, i);
    node->connection = &connections_[i % channels];
    v1::RegisterNodeRequest& request = node->registration;
    request.set_node_id(node->id);
    request.set_hostname(node->id);
    request.set_address(absl::StrCat(node->id, ".bench.invalid:50052"));
    request.set_worker_version("control-plane-bench");
    v1::NodeResources* resources = request.mutable_resources();
    resources->set_cpu_cores(224);
    resources->set_memory_bytes(int64_t{2} << 40);
    for (int g = 0; g < options_.gpus_per_node; ++g) {
      v1::GpuDevice* gpu = resources->add_gpus();
      gpu->set_index(g);
      gpu->set_uuid(absl::StrCat("GPU-", node->id, "-", g));
      gpu->set_name(options_.gpu_name);
      gpu->set_memory_bytes(options_.gpu_memory_bytes);
      gpu->set_compute_capability_major(9);
      gpu->set_compute_capability_minor(0);
      gpu->set_peak_bf16_flops(989e12);
    }
    nodes_.push_back(std::move(node));
  }
}

SimulatedFleet::~SimulatedFleet() { Stop(); }

void SimulatedFleet::Start() {
  threads_.emplace_back([this] { RegistrationLoop(); });
  threads_.emplace_back([this] { HeartbeatLoop(); });
}

int SimulatedFleet::WaitRegistered(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (registered_.load() < options_.nodes && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return static_cast<int>(registered_.load());
}

void SimulatedFleet::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  for (auto& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
  for (auto& node : nodes_) {
    std::shared_ptr<Watch> watch;
    {
      absl::MutexLock lock(&node->mu);
      watch = node->watch;
    }
    if (watch != nullptr) watch->Cancel();
  }
  // Every call ends by its deadline, so this ends too.
  while (calls_in_flight_.load(std::memory_order_acquire) > 0) {
    absl::SleepFor(absl::Milliseconds(1));
  }
}

FleetCounters SimulatedFleet::counters() const {
  FleetCounters counters;
  counters.registered = registered_.load();
  counters.register_failures = register_failures_.load();
  counters.heartbeats_ok = heartbeats_ok_.load();
  counters.heartbeat_failures = heartbeat_failures_.load();
  counters.heartbeats_skipped = heartbeats_skipped_.load();
  counters.slots_covered = slots_covered_.load();
  counters.timer_heartbeats = timer_heartbeats_.load();
  counters.reregister_requests = reregister_requests_.load();
  counters.tasks_started = tasks_started_.load();
  counters.tasks_succeeded = tasks_succeeded_.load();
  counters.stop_orders = stop_orders_.load();
  counters.reports_ok = reports_ok_.load();
  counters.report_failures = report_failures_.load();
  counters.health_failures = health_failures_.load();
  counters.pacer_resets = pacer_resets_.load();
  counters.watches_opened = watches_opened_.load();
  counters.notices = notices_.load();
  counters.notified_heartbeats = notified_heartbeats_.load();
  counters.watch_failures = watch_failures_.load();
  counters.end_announcements = end_announcements_.load();
  absl::MutexLock lock(&error_mu_);
  counters.first_error = first_error_;
  return counters;
}

std::unique_ptr<grpc::ClientContext> SimulatedFleet::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  return context;
}

absl::Duration SimulatedFleet::RunTime(const std::string& job_id) const {
  // Every node of a gang derives the same time from the job id.
  const double unit = static_cast<double>(std::hash<std::string>{}(job_id) % 1000) / 999.0;
  return options_.min_run_time + (options_.max_run_time - options_.min_run_time) * unit;
}

void SimulatedFleet::NoteError(const std::string& what, const grpc::Status& status) {
  absl::MutexLock lock(&error_mu_);
  if (first_error_.empty()) {
    first_error_ = absl::StrCat(what, ": ", status.error_code(), " ", status.error_message());
  }
}

void SimulatedFleet::RegistrationLoop() {
  for (auto& node : nodes_) {
    while (registers_in_flight_.load() >= options_.register_concurrency) {
      if (stop_.WaitForNotificationWithTimeout(absl::Milliseconds(1))) return;
    }
    if (stop_.HasBeenNotified()) return;
    SendRegister(*node);
  }
}

void SimulatedFleet::SendRegister(Node& node) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    v1::RegisterNodeResponse response;
    Clock::time_point sent;
  };
  auto call = std::make_shared<Call>();
  call->context = NewContext();
  call->sent = Clock::now();
  registers_in_flight_.fetch_add(1);
  CallStarted();
  node.connection->nodes->async()->RegisterNode(
      call->context.get(), &node.registration, &call->response,
      [this, &node, call](grpc::Status status) {
        const Clock::time_point done = Clock::now();
        {
          absl::MutexLock lock(&node.mu);
          node.registering = false;
          node.registered = status.ok();
        }
        if (status.ok()) {
          register_latency_.Record(done, SecondsBetween(call->sent, done));
          registered_.fetch_add(1);
          if (options_.watch_assignments) OpenWatch(node);
        } else {
          register_failures_.fetch_add(1);
          NoteError("RegisterNode", status);
        }
        registers_in_flight_.fetch_sub(1);
        CallDone();
      });
}

void SimulatedFleet::OpenWatch(Node& node) {
  if (stop_.HasBeenNotified()) return;
  std::shared_ptr<Watch> watch;
  {
    absl::MutexLock lock(&node.mu);
    if (node.watch != nullptr) return;
    watch = node.watch = std::make_shared<Watch>(this, &node);
  }
  watch->Start(watch);
}

void SimulatedFleet::OnNotice(Node& node) { BeatSoon(node, &notified_heartbeats_); }

void SimulatedFleet::BeatSoon(Node& node, std::atomic<int64_t>* counter) {
  if (stop_.HasBeenNotified()) return;
  {
    absl::MutexLock lock(&node.mu);
    if (!node.registered) return;
    if (node.heartbeat_in_flight) {
      node.beat_requested = true;
      return;
    }
  }
  counter->fetch_add(1);
  Beat(node, /*at_slot=*/false);
}

void SimulatedFleet::AnnounceEndAt(Node& node, Clock::time_point at) {
  absl::MutexLock lock(&due_mu_);
  due_.push({.at = at, .node = &node, .end = true, .after = {}});
}

void SimulatedFleet::BeatWhatIsDue(Clock::time_point now) {
  std::vector<Due> due;
  {
    absl::MutexLock lock(&due_mu_);
    while (!due_.empty() && due_.top().at <= now) {
      due.push_back(due_.top());
      due_.pop();
    }
  }
  for (const Due& item : due) {
    if (item.end) {
      end_announcements_.fetch_add(1);
      BeatSoon(*item.node, &notified_heartbeats_);
      continue;
    }
    {
      absl::MutexLock lock(&item.node->mu);
      if (item.node->last_out_of_slot != item.after) continue;  // a later one restarted it
    }
    BeatSoon(*item.node, &timer_heartbeats_);
  }
}

void SimulatedFleet::HeartbeatLoop() {
  const size_t count = nodes_.size();
  if (count == 0) return;
  const std::chrono::nanoseconds period = absl::ToChronoNanoseconds(options_.heartbeat_interval);
  // Every health_stride-th slot also carries a health check, from this
  // thread on that node's connection: the baseline sees the same
  // conditions as the heartbeats it is compared with.
  const double beats_per_second =
      static_cast<double>(count) / absl::ToDoubleSeconds(options_.heartbeat_interval);
  const int64_t health_stride =
      options_.health_checks_per_second > 0
          ? std::max<int64_t>(1, std::llround(beats_per_second / options_.health_checks_per_second))
          : 0;
  int64_t slot = 0;
  Clock::time_point round_start = Clock::now();
  size_t cursor = 0;
  while (!stop_.WaitForNotificationWithTimeout(kPacerTick)) {
    const Clock::time_point now = Clock::now();
    BeatWhatIsDue(now);
    if (now - round_start >= 2 * period) {
      // More than a period behind: start over rather than burst.
      pacer_resets_.fetch_add(1);
      round_start = now;
      cursor = 0;
      continue;
    }
    // Node i's slot is at round_start + i/count of the period.
    const double elapsed =
        static_cast<double>((now - round_start).count()) / static_cast<double>(period.count());
    const size_t due = std::min(count, static_cast<size_t>(std::floor(elapsed * count)) + 1);
    for (; cursor < due; ++cursor) {
      Beat(*nodes_[cursor], /*at_slot=*/true);
      if (health_stride > 0 && ++slot % health_stride == 0)
        CheckHealth(*nodes_[cursor]->connection);
    }
    if (cursor == count) {
      round_start += period;
      cursor = 0;
    }
  }
}

void SimulatedFleet::Beat(Node& node, bool at_slot) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    v1::HeartbeatRequest request;
    v1::HeartbeatResponse response;
    Clock::time_point sent;
  };
  auto call = std::make_shared<Call>();
  std::vector<std::pair<std::string, v1::ReportRequest>> final_reports;
  std::optional<Clock::time_point> timer_after;  // out of slot: the next is due a period later
  {
    absl::MutexLock lock(&node.mu);
    if (!node.registered) {
      // Asked to register again; unless a registration is under way, this
      // slot carries it.
      if (node.registering) return;
      node.registering = true;
    } else if (node.heartbeat_in_flight) {
      // A worker's heartbeats are sequential: this slot is lost.
      heartbeats_skipped_.fetch_add(1);
      return;
    } else if (at_slot &&
               Clock::now() - node.last_out_of_slot <
                   kSlotCoveredWithin * absl::ToChronoNanoseconds(options_.heartbeat_interval)) {
      slots_covered_.fetch_add(1);
      return;
    } else {
      if (!at_slot) {
        node.last_out_of_slot = Clock::now();
        timer_after = node.last_out_of_slot;
      }
      node.heartbeat_in_flight = true;
      call->request = HeartbeatLocked(node, &final_reports);
    }
  }
  if (timer_after.has_value()) {
    absl::MutexLock lock(&due_mu_);
    due_.push({.at = *timer_after + absl::ToChronoNanoseconds(options_.heartbeat_interval),
               .node = &node,
               .end = false,
               .after = *timer_after});
  }
  if (call->request.node_id().empty()) {
    SendRegister(node);
    return;
  }
  for (auto& [task_id, report] : final_reports) {
    SendReport(node, task_id, std::move(report), /*finishes_task=*/true);
  }
  call->context = NewContext();
  call->sent = Clock::now();
  CallStarted();
  node.connection->nodes->async()->Heartbeat(call->context.get(), &call->request, &call->response,
                                             [this, &node, call](grpc::Status status) {
                                               OnHeartbeatDone(node, call->request, call->response,
                                                               status, call->sent);
                                               CallDone();
                                             });
}

v1::HeartbeatRequest SimulatedFleet::HeartbeatLocked(
    Node& node, std::vector<std::pair<std::string, v1::ReportRequest>>* final_reports) {
  v1::HeartbeatRequest request;
  request.set_node_id(node.id);
  *request.mutable_gpu_metrics() = gpu_metrics_template_.gpu_metrics();
  const Clock::time_point now = Clock::now();
  for (auto& [task_id, task] : node.tasks) {
    if (task.state == v1::TASK_STATE_RUNNING && !task.finishing && now >= task.finish_at) {
      if (task.holds_rank0 && options_.metric_steps_per_job > 0) {
        // Rank 0's last metrics go out first; the task succeeds once the
        // coordinator has them, as a trainer exits after its last report.
        task.finishing = true;
        v1::ReportRequest report;
        report.set_node_id(node.id);
        report.set_task_id(task_id);
        report.set_first_sequence(task.next_sequence);
        for (int step = 1; step <= options_.metric_steps_per_job; ++step) {
          v1::TrainerReport* r = report.add_reports();
          r->set_job_id(task.job_id);
          r->set_attempt(task.attempt);
          r->set_rank(0);
          v1::StepMetrics* metrics = r->mutable_metrics();
          metrics->set_step(step);
          metrics->set_loss(11.0 - 0.1 * step);
          metrics->set_grad_norm(1.0);
          metrics->set_learning_rate(6e-4);
          metrics->set_tokens_per_second(1.2e6);
          metrics->set_step_time_seconds(0.4);
        }
        task.next_sequence += options_.metric_steps_per_job;
        final_reports->emplace_back(task_id, std::move(report));
      } else {
        task.state = v1::TASK_STATE_SUCCEEDED;
      }
    }
    *request.add_tasks() = StatusOf(task_id, task.job_id, task.attempt, task.state);
  }
  return request;
}

void SimulatedFleet::OnHeartbeatDone(Node& node, const v1::HeartbeatRequest& request,
                                     const v1::HeartbeatResponse& response,
                                     const grpc::Status& status, Clock::time_point sent) {
  const Clock::time_point done = Clock::now();
  if (!status.ok()) {
    heartbeat_failures_.fetch_add(1);
    NoteError("Heartbeat", status);
    absl::MutexLock lock(&node.mu);
    node.heartbeat_in_flight = false;
    return;
  }
  heartbeat_latency_.Record(done, SecondsBetween(sent, done));
  heartbeats_ok_.fetch_add(1);
  struct Delivery {
    std::string job_id;
    int ranks;
    int world_size;
  };
  std::vector<Delivery> deliveries;
  std::vector<std::pair<std::string, v1::ReportRequest>> started_reports;
  std::vector<Clock::time_point> ends;  // of the tasks started here
  bool beat_again = false;
  bool stopped = false;
  {
    absl::MutexLock lock(&node.mu);
    node.heartbeat_in_flight = false;
    beat_again = std::exchange(node.beat_requested, false);
    if (response.reregister()) {
      // The coordinator declared the node lost and failed its jobs.
      reregister_requests_.fetch_add(1);
      registered_.fetch_sub(1);
      node.registered = false;
      node.tasks.clear();
      return;
    }
    // A terminal state, once delivered, is not sent again.
    for (const v1::TaskStatus& sent_status : request.tasks()) {
      if (!IsTerminal(sent_status.state())) continue;
      node.tasks.erase(sent_status.task_id());
      if (sent_status.state() == v1::TASK_STATE_SUCCEEDED) tasks_succeeded_.fetch_add(1);
    }
    for (const v1::TaskAssignment& start : response.start()) {
      if (start.trainers().empty() || node.tasks.contains(start.task_id())) continue;
      const v1::TrainerTask& first = start.trainers(0);
      Task task;
      task.job_id = first.job_id();
      task.attempt = first.attempt();
      task.finish_at = done + absl::ToChronoNanoseconds(RunTime(task.job_id));
      for (const v1::TrainerTask& trainer : start.trainers()) {
        task.holds_rank0 |= trainer.assignment().rank() == 0;
      }
      if (task.holds_rank0) {
        v1::ReportRequest report;
        report.set_node_id(node.id);
        report.set_task_id(start.task_id());
        report.set_first_sequence(task.next_sequence++);
        v1::TrainerReport* r = report.add_reports();
        r->set_job_id(task.job_id);
        r->set_attempt(task.attempt);
        r->set_rank(0);
        v1::TrainerStarted* started = r->mutable_started();
        started->set_num_parameters(kReportedParameters);
        started->set_device(absl::StrCat("cuda:0 (", options_.gpu_name, ")"));
        started->set_backend("nccl");
        started_reports.emplace_back(start.task_id(), std::move(report));
      }
      deliveries.push_back({task.job_id, start.trainers_size(), first.assignment().world_size()});
      ends.push_back(task.finish_at);
      node.tasks.emplace(start.task_id(), std::move(task));
      tasks_started_.fetch_add(1);
    }
    for (const std::string& task_id : response.stop()) {
      stop_orders_.fetch_add(1);
      auto it = node.tasks.find(task_id);
      if (it != node.tasks.end() && !IsTerminal(it->second.state)) {
        it->second.state = v1::TASK_STATE_STOPPED;
        stopped = true;
      }
    }
  }
  if (options_.announce_ends) {
    for (Clock::time_point end : ends) AnnounceEndAt(node, end);
  }
  for (auto& [task_id, report] : started_reports) {
    SendReport(node, task_id, std::move(report), /*finishes_task=*/false);
  }
  if (on_delivery_) {
    for (const Delivery& delivery : deliveries) {
      on_delivery_(delivery.job_id, delivery.ranks, delivery.world_size, done);
    }
  }
  if (options_.announce_ends && stopped) {
    end_announcements_.fetch_add(1);
    beat_again = true;
  }
  if (beat_again && !stop_.HasBeenNotified()) {
    notified_heartbeats_.fetch_add(1);
    Beat(node, /*at_slot=*/false);
  }
}

void SimulatedFleet::SendReport(Node& node, const std::string& task_id, v1::ReportRequest request,
                                bool finishes_task) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    v1::ReportRequest request;
    v1::ReportResponse response;
    Clock::time_point sent;
  };
  auto call = std::make_shared<Call>();
  call->context = NewContext();
  call->request = std::move(request);
  call->sent = Clock::now();
  CallStarted();
  node.connection->nodes->async()->Report(
      call->context.get(), &call->request, &call->response,
      [this, &node, task_id, finishes_task, call](grpc::Status status) {
        const Clock::time_point done = Clock::now();
        if (status.ok()) {
          report_latency_.Record(done, SecondsBetween(call->sent, done));
          reports_ok_.fetch_add(1);
        } else {
          report_failures_.fetch_add(1);
          NoteError("Report", status);
        }
        if (finishes_task) {
          // The trainer is done whether or not its last report landed.
          bool ended = false;
          {
            absl::MutexLock lock(&node.mu);
            auto it = node.tasks.find(task_id);
            if (it != node.tasks.end() && it->second.state == v1::TASK_STATE_RUNNING) {
              it->second.state = v1::TASK_STATE_SUCCEEDED;
              it->second.finishing = false;
              ended = true;
            }
          }
          if (ended && options_.announce_ends) {
            end_announcements_.fetch_add(1);
            BeatSoon(node, &notified_heartbeats_);
          }
        }
        CallDone();
      });
}

void SimulatedFleet::CheckHealth(Connection& connection) {
  struct Call {
    std::unique_ptr<grpc::ClientContext> context;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    Clock::time_point sent;
  };
  if (health_checks_in_flight_.load() >= kMaxHealthChecksInFlight) return;
  auto call = std::make_shared<Call>();
  call->context = NewContext();
  call->sent = Clock::now();
  health_checks_in_flight_.fetch_add(1);
  CallStarted();
  connection.health->async()->Check(
      call->context.get(), &call->request, &call->response, [this, call](grpc::Status status) {
        const Clock::time_point done = Clock::now();
        if (status.ok()) {
          health_latency_.Record(done, SecondsBetween(call->sent, done));
        } else {
          health_failures_.fetch_add(1);
          NoteError("Health/Check", status);
        }
        health_checks_in_flight_.fetch_sub(1);
        CallDone();
      });
}

}  // namespace tessera::bench
