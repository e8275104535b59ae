#include "coordinator/service/coordinator_metrics.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/interceptor.h"
#include "grpcpp/support/status.h"

namespace tessera::coordinator {
namespace {

using ::grpc::experimental::InterceptionHookPoints;
using Buckets = prometheus::Histogram::BucketBoundaries;

// Submission -> SCHEDULED: from an idle cluster's milliseconds to an hour in
// the queue.
Buckets SchedulingLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,  1,   2.5,
          5,     10,     30,    60,   120,   300,  600, 1200, 1800, 3600};
}

// A job's wait in its queue: an idle cluster's fraction of a second to a week behind a busy quota.
Buckets QueueWaitBuckets() {
  return {0.1,  0.5,  1,     5,     15,    30,    60,     300,    600,   1800,
          3600, 7200, 14400, 28800, 57600, 86400, 172800, 345600, 604800};
}

// In-process work (a scheduler pass, a SQLite transaction): 100 us to 10 s.
Buckets FastOperationBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
}

// RPCs: unary calls take milliseconds, log streams may stay open for an hour.
Buckets RpcBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
          0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    300,  3600};
}

// JOB_STATE_PENDING -> "pending".
std::string StateLabel(const std::string& enum_name, absl::string_view prefix) {
  return absl::AsciiStrToLower(absl::StripPrefix(enum_name, prefix));
}

// "OK", "UNIMPLEMENTED", ...: gRPC and Abseil share the canonical codes.
std::string CodeLabel(grpc::StatusCode code) {
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? absl::StrCat(static_cast<int>(code)) : name;
}

// Whether `method` ("/package.Service/Method") names a method of a service
// compiled into this binary. A client may send any name; only these become
// label values, so the series stay bounded.
bool IsKnownMethod(absl::string_view method) {
  // Served by gRPC itself (health checking, reflection), whose descriptors are not in this
  // binary's pool.
  static constexpr absl::string_view kGrpcMethods[] = {
      "/grpc.health.v1.Health/Check",
      "/grpc.health.v1.Health/Watch",
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
  };
  for (absl::string_view known : kGrpcMethods) {
    if (method == known) return true;
  }
  if (!absl::ConsumePrefix(&method, "/")) return false;
  const size_t slash = method.rfind('/');
  if (slash == absl::string_view::npos) return false;
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          std::string(method.substr(0, slash)));
  return service != nullptr &&
         service->FindMethodByName(std::string(method.substr(slash + 1))) != nullptr;
}

void SetOrZero(prometheus::Gauge* gauge, int64_t value) {
  if (gauge != nullptr) gauge->Set(static_cast<double>(value));
}

// One per call. Records the call when its status is about to be sent, or,
// for a call that never sends one, when gRPC destroys the call.
class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(CoordinatorMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {
    metrics_->RecordStart(method_);
  }

  ~MetricsInterceptor() override {
    if (!recorded_) Record(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    recorded_ = true;
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_;
    metrics_->RecordRequest(method_, code, elapsed.count());
  }

  CoordinatorMetrics* metrics_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
  bool recorded_ = false;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(CoordinatorMetrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // No method name: a call gRPC answers itself; nothing to attribute it to.
    if (info->method() == nullptr) return nullptr;
    return new MetricsInterceptor(metrics_, info->method());
  }

 private:
  CoordinatorMetrics* metrics_;
};

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry)
    : gpus_capacity_(prometheus::BuildGauge()
                         .Name("tessera_gpus_capacity")
                         .Help("GPUs on the nodes that take work (ready nodes).")
                         .Register(registry)
                         .Add({})),
      gpus_allocated_(prometheus::BuildGauge()
                          .Name("tessera_gpus_allocated")
                          .Help("GPUs held by scheduled and running jobs.")
                          .Register(registry)
                          .Add({})),
      cpu_slots_capacity_(prometheus::BuildGauge()
                              .Name("tessera_cpu_slots_capacity")
                              .Help("CPU trainer slots on the nodes that take work (ready nodes).")
                              .Register(registry)
                              .Add({})),
      cpu_slots_allocated_(prometheus::BuildGauge()
                               .Name("tessera_cpu_slots_allocated")
                               .Help("CPU trainer slots held by scheduled and running jobs.")
                               .Register(registry)
                               .Add({})),
      scheduling_latency_(prometheus::BuildHistogram()
                              .Name("tessera_scheduling_latency_seconds")
                              .Help("Time from a job's submission until it is SCHEDULED, in "
                                    "seconds.")
                              .Register(registry)
                              .Add({}, SchedulingLatencyBuckets())),
      scheduler_pass_duration_(prometheus::BuildHistogram()
                                   .Name("tessera_scheduler_pass_duration_seconds")
                                   .Help("Duration of one pass of the gang scheduler, in seconds.")
                                   .Register(registry)
                                   .Add({}, FastOperationBuckets())),
      scheduler_pass_lock_held_(prometheus::BuildHistogram()
                                    .Name("tessera_scheduler_pass_lock_held_seconds")
                                    .Help("Time one scheduler pass held the cluster lock, in "
                                          "seconds (heartbeats wait for it).")
                                    .Register(registry)
                                    .Add({}, FastOperationBuckets())),
      scheduler_pass_longest_lock_hold_(
          prometheus::BuildHistogram()
              .Name("tessera_scheduler_pass_longest_lock_hold_seconds")
              .Help("Longest single hold of the cluster lock in one scheduler pass, in seconds.")
              .Register(registry)
              .Add({}, FastOperationBuckets())),
      store_write_duration_(prometheus::BuildHistogram()
                                .Name("tessera_store_write_duration_seconds")
                                .Help("Duration of one write transaction of the job store, in "
                                      "seconds.")
                                .Register(registry)
                                .Add({}, FastOperationBuckets())),
      store_write_cpu_seconds_(
          prometheus::BuildCounter()
              .Name("tessera_store_write_cpu_seconds_total")
              .Help("CPU time of the job store's write transactions, in seconds. They run one at "
                    "a time, so its rate is the share of one core the store's writer uses.")
              .Register(registry)
              .Add({})),
      store_writes_(prometheus::BuildCounter()
                        .Name("tessera_store_writes_total")
                        .Help("Writes applied by the job store's transactions (a job's change, "
                              "a node record, a job id).")
                        .Register(registry)
                        .Add({})),
      scheduler_pass_phases_(prometheus::BuildHistogram()
                                 .Name("tessera_scheduler_pass_phase_seconds")
                                 .Help("Wall time one scheduler pass spent in each phase, in "
                                       "seconds (waits included).")
                                 .Register(registry)),
      grpc_requests_(prometheus::BuildCounter()
                         .Name("tessera_grpc_server_requests_total")
                         .Help("gRPC calls finished by the coordinator, by full method name "
                               "and status code.")
                         .Register(registry)),
      grpc_request_duration_(prometheus::BuildHistogram()
                                 .Name("tessera_grpc_server_request_duration_seconds")
                                 .Help("Duration of gRPC calls from their start until their "
                                       "status is sent (for streams, the whole stream), in "
                                       "seconds.")
                                 .Register(registry)),
      grpc_started_(prometheus::BuildCounter()
                        .Name("tessera_grpc_server_started_total")
                        .Help("gRPC calls that reached the coordinator, by full method name "
                              "(minus tessera_grpc_server_requests_total: the calls in flight).")
                        .Register(registry)),
      restarts_(prometheus::BuildCounter()
                    .Name("tessera_job_restarts_total")
                    .Help("Job restarts the coordinator decided, by the kind of the failure "
                          "blamed for the attempt that ended.")
                    .Register(registry)),
      failures_(prometheus::BuildCounter()
                    .Name("tessera_job_failures_total")
                    .Help("Jobs that ended FAILED, by the kind of the failure blamed for their "
                          "last attempt.")
                    .Register(registry)),
      oldest_pending_(prometheus::BuildGauge()
                          .Name("tessera_job_oldest_pending_seconds")
                          .Help("Seconds the oldest PENDING job has waited since its "
                                "submission (0 when none waits).")
                          .Register(registry)
                          .Add({})),
      job_series_(std::make_shared<JobSeries>()) {
  const std::array<std::pair<const char*, const char*>, kQueueFamilies> queue_families = {{
      {"tessera_queue_nominal_gpus", "A queue's nominal (guaranteed) GPU quota."},
      {"tessera_queue_nominal_cpu_slots", "A queue's nominal (guaranteed) CPU-slot quota."},
      {"tessera_queue_used_gpus", "GPUs a queue's jobs hold."},
      {"tessera_queue_used_cpu_slots", "CPU slots a queue's jobs hold."},
      {"tessera_queue_borrowed_gpus", "GPUs a queue's jobs hold beyond its nominal quota."},
      {"tessera_queue_borrowed_cpu_slots",
       "CPU slots a queue's jobs hold beyond its nominal quota."},
      {"tessera_queue_waiting_jobs", "A queue's jobs waiting for devices."},
      {"tessera_queue_fair_share",
       "A queue's decayed dominant-resource usage over its weight; within a cohort the lowest "
       "borrows first."},
      {"tessera_queue_running_jobs",
       "A queue's jobs placed on devices (scheduled, running or being preempted)."},
  }};
  for (int i = 0; i < kQueueFamilies; ++i) {
    queue_families_[i] = &prometheus::BuildGauge()
                              .Name(queue_families[i].first)
                              .Help(queue_families[i].second)
                              .Register(registry);
  }
  const std::array<std::pair<const char*, const char*>, kTopologyFamilies> topology_families = {{
      {"tessera_topology_domains",
       "Domains of a topology level (a node without a label at the "
       "level is a domain of its own)."},
      {"tessera_topology_whole_free_domains",
       "Domains of a topology level whose devices (GPUs, or CPU slots without GPUs) are all "
       "free."},
      {"tessera_topology_largest_free_domain_devices",
       "The most free devices in one domain of a topology level: the largest gang that fits "
       "inside one."},
      {"tessera_topology_free_devices", "Free devices of the ready nodes, counted per level."},
      {"tessera_topology_fragmentation",
       "Share of the free devices that sit in partly used domains of a topology level: 0 when "
       "every free device is in a wholly free domain, 1 when none is."},
  }};
  for (int i = 0; i < kTopologyFamilies; ++i) {
    topology_families_[i] = &prometheus::BuildGauge()
                                 .Name(topology_families[i].first)
                                 .Help(topology_families[i].second)
                                 .Register(registry);
  }
  queue_preemptions_ = &prometheus::BuildCounter()
                            .Name("tessera_queue_preemptions_total")
                            .Help(
                                "A queue's jobs preempted (asked to save a checkpoint and stop) "
                                "since the coordinator started, by reason: \"reclaim\" (a "
                                "queue took back its lent quota) or \"priority\".")
                            .Register(registry);
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("tessera_queue_wait_seconds")
                     .Help(
                         "Seconds a job waited in its queue until it was SCHEDULED: from its "
                         "submission, or for a later attempt from the previous one's end.")
                     .Register(registry);
  auto& jobs = prometheus::BuildGauge()
                   .Name("tessera_jobs")
                   .Help("Jobs known to the coordinator, by state.")
                   .Register(registry);
  for (int state = v1::JobState_MIN; state <= v1::JobState_MAX; ++state) {
    if (state == v1::JOB_STATE_UNSPECIFIED || !v1::JobState_IsValid(state)) continue;
    job_gauges_[state] = &jobs.Add(
        {{"state", StateLabel(v1::JobState_Name(static_cast<v1::JobState>(state)), "JOB_STATE_")}});
  }
  auto& nodes = prometheus::BuildGauge()
                    .Name("tessera_nodes")
                    .Help("Worker nodes registered with the coordinator, by state.")
                    .Register(registry);
  for (int state = v1::NodeState_MIN; state <= v1::NodeState_MAX; ++state) {
    if (state == v1::NODE_STATE_UNSPECIFIED || !v1::NodeState_IsValid(state)) continue;
    node_gauges_[state] =
        &nodes.Add({{"state", StateLabel(v1::NodeState_Name(static_cast<v1::NodeState>(state)),
                                         "NODE_STATE_")}});
  }
  // Every kind's counters exist from the start at 0: a series that first appears at 1 has no
  // baseline, and increase() over it reads 0, so an alert on the first failure would never fire.
  for (int kind = v1::FailureKind_MIN; kind <= v1::FailureKind_MAX; ++kind) {
    if (kind == v1::FAILURE_KIND_UNSPECIFIED || !v1::FailureKind_IsValid(kind)) continue;
    const prometheus::Labels labels = {
        {"kind", StateLabel(v1::FailureKind_Name(static_cast<v1::FailureKind>(kind)),
                            "FAILURE_KIND_")}};
    restarts_.Add(labels);
    failures_.Add(labels);
  }
}

void CoordinatorMetrics::SetJobCounts(const std::map<v1::JobState, int64_t>& counts) {
  for (size_t state = 0; state < job_gauges_.size(); ++state) {
    const auto it = counts.find(static_cast<v1::JobState>(state));
    SetOrZero(job_gauges_[state], it == counts.end() ? 0 : it->second);
  }
}

void CoordinatorMetrics::SetNodeCounts(const std::map<v1::NodeState, int64_t>& counts) {
  for (size_t state = 0; state < node_gauges_.size(); ++state) {
    const auto it = counts.find(static_cast<v1::NodeState>(state));
    SetOrZero(node_gauges_[state], it == counts.end() ? 0 : it->second);
  }
}

void CoordinatorMetrics::SetGpus(int64_t total, int64_t allocated) {
  gpus_capacity_.Set(static_cast<double>(total));
  gpus_allocated_.Set(static_cast<double>(allocated));
}

void CoordinatorMetrics::SetCpuSlots(int64_t total, int64_t allocated) {
  cpu_slots_capacity_.Set(static_cast<double>(total));
  cpu_slots_allocated_.Set(static_cast<double>(allocated));
}

namespace {

// Advances the counters of `family` by kind to the cumulative `totals`; `seen` holds the totals
// of the previous call.
void AdvanceByKind(prometheus::Family<prometheus::Counter>& family,
                   const std::map<v1::FailureKind, int64_t>& totals,
                   std::map<v1::FailureKind, int64_t>& seen) {
  for (const auto& [kind, total] : totals) {
    int64_t& previous = seen[kind];
    if (total <= previous) continue;
    family.Add({{"kind", StateLabel(v1::FailureKind_Name(kind), "FAILURE_KIND_")}})
        .Increment(static_cast<double>(total - previous));
    previous = total;
  }
}

}  // namespace

void CoordinatorMetrics::SetRestarts(const std::map<v1::FailureKind, int64_t>& restarts) {
  absl::MutexLock lock(&mu_);
  AdvanceByKind(restarts_, restarts, restarts_seen_);
}

void CoordinatorMetrics::SetFailures(const std::map<v1::FailureKind, int64_t>& failures) {
  absl::MutexLock lock(&mu_);
  AdvanceByKind(failures_, failures, failures_seen_);
}

void CoordinatorMetrics::SetOldestPendingSeconds(double seconds) { oldest_pending_.Set(seconds); }

void CoordinatorMetrics::SetQueues(
    const std::map<std::string, ClusterStats::QueueFigures>& queues) {
  absl::MutexLock lock(&mu_);
  for (auto it = queue_series_.begin(); it != queue_series_.end();) {
    if (queues.contains(it->first)) {
      ++it;
      continue;
    }
    for (int i = 0; i < kQueueFamilies; ++i) queue_families_[i]->Remove(it->second[i]);
    // Its counters and wait histogram go too; preemptions_seen_ stays, so that a queue listed
    // again counts on from its cumulative figure (Prometheus reads the new series as a reset).
    for (const auto& [key, total] : preemptions_seen_) {
      if (key.first != it->first) continue;
      queue_preemptions_->Remove(
          &queue_preemptions_->Add({{"queue", key.first}, {"reason", key.second}}));
    }
    if (auto wait = queue_wait_series_.find(it->first); wait != queue_wait_series_.end()) {
      queue_wait_->Remove(wait->second);
      queue_wait_series_.erase(wait);
    }
    it = queue_series_.erase(it);
  }
  for (const auto& [queue, figures] : queues) {
    auto [it, added] = queue_series_.try_emplace(queue);
    if (added) {
      for (int i = 0; i < kQueueFamilies; ++i) {
        it->second[i] = &queue_families_[i]->Add({{"queue", queue}});
      }
    }
    const std::array<double, kQueueFamilies> values = {
        static_cast<double>(figures.nominal.gpus),  static_cast<double>(figures.nominal.cpu_slots),
        static_cast<double>(figures.used.gpus),     static_cast<double>(figures.used.cpu_slots),
        static_cast<double>(figures.borrowed.gpus), static_cast<double>(figures.borrowed.cpu_slots),
        static_cast<double>(figures.waiting_jobs),  figures.fair_share,
        static_cast<double>(figures.running_jobs)};
    for (int i = 0; i < kQueueFamilies; ++i) it->second[i]->Set(values[i]);
    if (added) {
      // From 0, so that increase() and rate() see the first preemption and the first wait.
      for (const char* reason : kPreemptionReasons) {
        preemptions_seen_.try_emplace({queue, reason}, 0);
        queue_preemptions_->Add({{"queue", queue}, {"reason", reason}});
      }
      prometheus::Histogram*& wait = queue_wait_series_[queue];
      if (wait == nullptr) wait = &queue_wait_->Add({{"queue", queue}}, QueueWaitBuckets());
    }
    for (const auto& [reason, total] : figures.preemptions) {
      int64_t& previous = preemptions_seen_[{queue, reason}];
      if (total <= previous) continue;
      queue_preemptions_->Add({{"queue", queue}, {"reason", reason}})
          .Increment(static_cast<double>(total - previous));
      previous = total;
    }
  }
}

void CoordinatorMetrics::SetTopology(const std::vector<TopologyLevelFigures>& levels) {
  absl::MutexLock lock(&mu_);
  for (const TopologyLevelFigures& level : levels) {
    auto [it, added] = topology_series_.try_emplace(level.level);
    if (added) {
      for (int i = 0; i < kTopologyFamilies; ++i) {
        it->second[i] = &topology_families_[i]->Add({{"level", level.level}});
      }
    }
    const std::array<double, kTopologyFamilies> values = {
        static_cast<double>(level.domains), static_cast<double>(level.whole_free_domains),
        static_cast<double>(level.largest_free), static_cast<double>(level.free),
        level.fragmentation};
    for (int i = 0; i < kTopologyFamilies; ++i) it->second[i]->Set(values[i]);
  }
}

void CoordinatorMetrics::ObserveQueueWait(const std::string& queue, double seconds) {
  prometheus::Histogram* series = nullptr;
  {
    absl::MutexLock lock(&mu_);
    // A queue's series is made with its other figures; one without them (no queue file, a job
    // of a queue no longer configured) gets one at its first wait.
    prometheus::Histogram*& found = queue_wait_series_[queue];
    if (found == nullptr) found = &queue_wait_->Add({{"queue", queue}}, QueueWaitBuckets());
    series = found;
  }
  series->Observe(seconds);
}

void CoordinatorMetrics::SetStragglers(
    const std::map<std::string, v1::StragglerReport>& stragglers) {
  job_series_->SetStragglers(stragglers);
}

namespace {

// Seconds since the epoch; nullopt for an unset timestamp (a report that carried none).
std::optional<double> UnixSeconds(const google::protobuf::Timestamp& time) {
  if (time.seconds() <= 0 && time.nanos() <= 0) return std::nullopt;
  return static_cast<double>(time.seconds()) + static_cast<double>(time.nanos()) * 1e-9;
}

}  // namespace

void CoordinatorMetrics::ApplyJobLocked(const v1::Job& job) {
  if (job.state() != v1::JOB_STATE_RUNNING) {
    job_series_->DropRunning(job.job_id());
    return;
  }
  // A timestamp is set with its first value and then only moves: a job that has reported no step
  // (or no checkpoint) yet has no series, rather than one at 1970.
  std::optional<double> last_step, last_checkpoint;
  if (job.has_latest_metrics()) last_step = UnixSeconds(job.latest_metrics().time());
  if (job.has_latest_checkpoint() && !job.latest_checkpoint().path().empty()) {
    last_checkpoint = UnixSeconds(job.latest_checkpoint().create_time());
  }
  job_series_->SetRunning(job.job_id(), last_step, last_checkpoint);
}

void CoordinatorMetrics::ObserveJob(const v1::Job& job) {
  absl::MutexLock lock(&mu_);
  if (!seeded_) observed_before_seed_.insert(job.job_id());
  ApplyJobLocked(job);
}

void CoordinatorMetrics::SeedRunningJobs(const std::vector<v1::Job>& running) {
  absl::MutexLock lock(&mu_);
  for (const v1::Job& job : running) {
    // A commit observed since the list was read is newer than the listed copy.
    if (!observed_before_seed_.contains(job.job_id())) ApplyJobLocked(job);
  }
  seeded_ = true;
  observed_before_seed_.clear();
}

void CoordinatorMetrics::ObserveSchedulingLatency(double seconds) {
  scheduling_latency_.Observe(seconds);
}

void CoordinatorMetrics::ObserveSchedulingPass(double seconds) {
  scheduler_pass_duration_.Observe(seconds);
}

void CoordinatorMetrics::ObserveSchedulingPassLock(double held_seconds,
                                                   double longest_hold_seconds) {
  scheduler_pass_lock_held_.Observe(held_seconds);
  scheduler_pass_longest_lock_hold_.Observe(longest_hold_seconds);
}

void CoordinatorMetrics::ObserveSchedulingPassPhases(
    const std::map<std::string, double>& phase_seconds) {
  absl::MutexLock lock(&mu_);
  for (const auto& [phase, seconds] : phase_seconds) {
    prometheus::Histogram*& series = phase_series_[phase];
    if (series == nullptr) {
      series = &scheduler_pass_phases_.Add({{"phase", phase}}, FastOperationBuckets());
    }
    series->Observe(seconds);
  }
}

void CoordinatorMetrics::ObserveStoreWrite(double seconds, double cpu_seconds, int writes) {
  store_write_duration_.Observe(seconds);
  store_write_cpu_seconds_.Increment(std::max(0.0, cpu_seconds));
  store_writes_.Increment(std::max(0, writes));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
CoordinatorMetrics::MakeInterceptorFactory() {
  return std::make_unique<MetricsInterceptorFactory>(this);
}

std::pair<const std::string*, CoordinatorMetrics::MethodSeries*> CoordinatorMetrics::MethodLocked(
    const std::string& method) {
  auto it = methods_.find(method);
  if (it == methods_.end()) {
    // Unknown names share one entry, so they cannot grow methods_ either.
    it = methods_.try_emplace(IsKnownMethod(method) ? method : std::string(kOtherMethod)).first;
  }
  return {&it->first, &it->second};
}

void CoordinatorMetrics::RecordStart(const std::string& method) {
  prometheus::Counter* started = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto [label, series] = MethodLocked(method);
    if (series->started == nullptr) series->started = &grpc_started_.Add({{"method", *label}});
    started = series->started;
  }
  started->Increment();
}

void CoordinatorMetrics::RecordRequest(const std::string& method, grpc::StatusCode code,
                                       double seconds) {
  const int code_index = static_cast<int>(code);
  prometheus::Counter* requests = nullptr;
  prometheus::Histogram* duration = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto [label, series] = MethodLocked(method);
    if (series->duration == nullptr) {
      series->duration = &grpc_request_duration_.Add({{"method", *label}}, RpcBuckets());
    }
    duration = series->duration;
    const bool canonical =
        code_index >= 0 && code_index < static_cast<int>(series->requests.size());
    if (canonical && series->requests[code_index] != nullptr) {
      requests = series->requests[code_index];
    } else {
      requests = &grpc_requests_.Add({{"method", *label}, {"code", CodeLabel(code)}});
      if (canonical) series->requests[code_index] = requests;
    }
  }
  requests->Increment();
  duration->Observe(seconds);
}

}  // namespace tessera::coordinator
