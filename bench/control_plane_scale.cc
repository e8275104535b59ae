#include "bench/control_plane_scale.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "bench/control_plane_process.h"
#include "bench/control_plane_prometheus.h"
#include "common/daemon/server.h"
#include "common/errno_status.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "tessera/v1/node_service.grpc.pb.h"

namespace tessera::bench {
namespace {

// Series of the coordinator's /metrics that the summary reads.
constexpr char kPassHistogram[] = "tessera_scheduler_pass_duration_seconds";
constexpr char kPassLockHistogram[] = "tessera_scheduler_pass_lock_held_seconds";
constexpr char kPassLongestHoldHistogram[] = "tessera_scheduler_pass_longest_lock_hold_seconds";
constexpr char kPassPhaseHistogram[] = "tessera_scheduler_pass_phase_seconds";
// "store_overlapped": the previous pass's store, run beside this pass (not part of its time).
constexpr const char* kPassPhases[] = {"list",  "settle", "plan",  "schedule",
                                       "admit", "store",  "count", "store_overlapped"};
constexpr char kStoreWriteHistogram[] = "tessera_store_write_duration_seconds";
constexpr char kStoreWriteCpuCounter[] = "tessera_store_write_cpu_seconds_total";
constexpr char kStoreWritesCounter[] = "tessera_store_writes_total";
constexpr char kSchedulingLatencyHistogram[] = "tessera_scheduling_latency_seconds";
constexpr char kRequestHistogram[] = "tessera_grpc_server_request_duration_seconds";
constexpr char kGpusAllocatedGauge[] = "tessera_gpus_allocated";
constexpr char kGpusCapacityGauge[] = "tessera_gpus_capacity";
constexpr char kPendingJobsGauge[] = R"(tessera_jobs{state="pending"})";
constexpr char kHeartbeatMethod[] = R"(method="/tessera.v1.NodeService/Heartbeat")";
constexpr char kHealthMethod[] = R"(method="/grpc.health.v1.Health/Check")";
constexpr char kSubmitMethod[] = R"(method="/tessera.v1.Coordinator/SubmitJob")";

absl::StatusOr<std::string> MakeTempDir(const std::string& parent, const std::string& prefix) {
  std::string pattern = absl::StrCat(parent, "/", prefix, ".XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return ErrnoToStatus(errno, pattern);
  return pattern;
}

// Removes a directory tree on scope exit unless told to keep it.
class DirectoryCleanup {
 public:
  DirectoryCleanup(std::string path, bool keep) : path_(std::move(path)), keep_(keep) {}
  ~DirectoryCleanup() {
    std::error_code ignored;
    if (!keep_) std::filesystem::remove_all(path_, ignored);
  }
  DirectoryCleanup(const DirectoryCleanup&) = delete;
  DirectoryCleanup& operator=(const DirectoryCleanup&) = delete;

 private:
  std::string path_;
  bool keep_;
};

double Mean(const HistogramTotals& totals) {
  return totals.count > 0 ? totals.sum / totals.count : 0;
}

CoordinatorInternals InternalsBetween(const MetricSamples& before, const MetricSamples& after,
                                      double seconds) {
  auto delta = [&](const char* name, const std::string& labels = "") {
    return Difference(HistogramIn(after, name, labels), HistogramIn(before, name, labels));
  };
  CoordinatorInternals internals;
  const HistogramTotals passes = delta(kPassHistogram);
  internals.passes_per_second = passes.count / seconds;
  internals.mean_pass_seconds = Mean(passes);
  internals.pass_duty = passes.sum / seconds;
  const HistogramTotals held = delta(kPassLockHistogram);
  if (held.count > 0) {
    internals.mean_lock_held_seconds = Mean(held);
    internals.mean_longest_lock_hold_seconds = Mean(delta(kPassLongestHoldHistogram));
    internals.lock_duty = held.sum / seconds;
  } else {
    internals.mean_lock_held_seconds = internals.mean_pass_seconds;
    internals.mean_longest_lock_hold_seconds = internals.mean_pass_seconds;
    internals.lock_duty = internals.pass_duty;
  }
  for (const char* phase : kPassPhases) {
    const HistogramTotals spent = delta(kPassPhaseHistogram, absl::StrCat("phase=\"", phase, "\""));
    if (spent.count > 0 && passes.count > 0) {
      internals.pass_phase_seconds.emplace_back(phase, spent.sum / passes.count);
    }
  }
  const HistogramTotals writes = delta(kStoreWriteHistogram);
  internals.store_writes_per_second = writes.count / seconds;
  internals.mean_store_write_seconds = Mean(writes);
  auto counter_delta = [&](const char* name) {
    const auto a = after.find(name), b = before.find(name);
    return (a != after.end() ? a->second : 0) - (b != before.end() ? b->second : 0);
  };
  const double writer_cpu = counter_delta(kStoreWriteCpuCounter);
  const double applied = counter_delta(kStoreWritesCounter);
  internals.store_writer_cores = writer_cpu / seconds;
  internals.store_cpu_per_write_seconds = applied > 0 ? writer_cpu / applied : 0;
  internals.mean_heartbeat_seconds = Mean(delta(kRequestHistogram, kHeartbeatMethod));
  internals.mean_health_seconds = Mean(delta(kRequestHistogram, kHealthMethod));
  internals.mean_submit_seconds = Mean(delta(kRequestHistogram, kSubmitMethod));
  const HistogramTotals scheduled = delta(kSchedulingLatencyHistogram);
  internals.mean_submit_to_scheduled_seconds = Mean(scheduled);
  internals.jobs_scheduled_per_second = scheduled.count / seconds;
  return internals;
}

double MeanOf(const std::vector<double>& values) {
  double sum = 0;
  for (double value : values) sum += value;
  return values.empty() ? 0 : sum / static_cast<double>(values.size());
}

// Scrapes the coordinator's cluster gauges every `period` until `stop` is notified.
ClusterOccupancy SampleOccupancy(int metrics_port, absl::Duration period,
                                 absl::Notification* stop) {
  std::vector<double> shares, pending;
  do {
    auto samples = ScrapeMetrics(metrics_port);
    if (!samples.ok()) continue;
    const auto allocated = samples->find(kGpusAllocatedGauge);
    const auto capacity = samples->find(kGpusCapacityGauge);
    const auto waiting = samples->find(kPendingJobsGauge);
    if (allocated == samples->end() || capacity == samples->end() || waiting == samples->end() ||
        capacity->second <= 0) {
      continue;
    }
    shares.push_back(allocated->second / capacity->second);
    pending.push_back(waiting->second);
  } while (!stop->WaitForNotificationWithTimeout(period));
  ClusterOccupancy occupancy;
  occupancy.samples = static_cast<int>(shares.size());
  occupancy.mean_gpus_allocated_share = MeanOf(shares);
  occupancy.mean_pending_jobs = MeanOf(pending);
  occupancy.gpus_allocated_share = SpreadOf(std::move(shares));
  occupancy.pending_jobs = SpreadOf(std::move(pending));
  return occupancy;
}

// Sleeps until `when`.
void SleepUntil(Clock::time_point when) {
  const Clock::time_point now = Clock::now();
  if (when > now) absl::SleepFor(absl::FromChrono(when - now));
}

// Waits until the coordinator leads: on PostgreSQL it starts as a standby (NodeService
// NOT_SERVING, RegisterNode refused) until it wins the election, which must not count as the
// fleet's join time. On SQLite it leads from the start.
absl::Status WaitUntilLeading(const std::string& address, absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(MakeClientChannel(address));
  const absl::Time deadline = absl::Now() + timeout;
  grpc::Status last;
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(v1::NodeService::service_full_name());
    grpc::health::v1::HealthCheckResponse response;
    last = health->Check(&context, request, &response);
    if (last.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::UnavailableError(absl::StrCat("the coordinator at ", address,
                                             " did not lead within ", absl::FormatDuration(timeout),
                                             " (last health check: ", last.error_message(), ")"));
}

}  // namespace

absl::StatusOr<ScaleResult> RunScale(const ScaleOptions& options) {
  ScaleResult result;
  result.scenario = options.scenario;
  result.backend = options.backend;
  result.nodes = options.fleet.nodes;
  result.offered_jobs_per_second = options.jobs.jobs_per_second;
  result.heartbeats_expected_per_second =
      options.fleet.nodes / absl::ToDoubleSeconds(options.fleet.heartbeat_interval);

  ASSIGN_OR_RETURN(
      const std::string dir,
      MakeTempDir(options.work_dir, absl::StrCat("tessera-control-plane-", options.fleet.nodes)));
  DirectoryCleanup cleanup(dir, options.keep_state);
  if (options.keep_state) result.notes.push_back(absl::StrCat("state kept in ", dir));
  std::string queue_file;
  if (!options.queue_file_yaml.empty()) {
    queue_file = absl::StrCat(dir, "/queues.yaml");
    std::ofstream out(queue_file);
    out << options.queue_file_yaml;
    out.close();
    if (!out) return ErrnoToStatus(errno, queue_file);
  }
  ASSIGN_OR_RETURN(
      auto coordinator,
      CoordinatorProcess::Start({.binary = options.coordinator_binary,
                                 .dir = dir,
                                 .state = options.state_url,
                                 .database_password_file = options.database_password_file,
                                 .heartbeat_timeout = options.coordinator_heartbeat_timeout,
                                 .queue_file = queue_file}));

  RETURN_IF_ERROR(WaitUntilLeading(coordinator->address(), kCoordinatorStartTimeout));

  JobStream jobs(MakeClientChannel(coordinator->address()), options.jobs);
  SimulatedFleet fleet(
      coordinator->address(), options.fleet,
      [&jobs](const std::string& job_id, int ranks, int world_size, Clock::time_point at) {
        jobs.OnDelivered(job_id, ranks, world_size, at);
      });

  const Clock::time_point register_start = Clock::now();
  fleet.Start();
  result.registered = fleet.WaitRegistered(options.register_timeout);
  result.register_seconds = SecondsBetween(register_start, Clock::now());
  result.register_latency = [&] {
    std::vector<double> seconds = fleet.register_latency().Between(register_start, Clock::now());
    return Summarize(seconds);
  }();
  if (result.registered < options.fleet.nodes) {
    result.notes.push_back(absl::StrCat("only ", result.registered, " of ", options.fleet.nodes,
                                        " nodes registered within ",
                                        absl::FormatDuration(options.register_timeout)));
  }
  ASSIGN_OR_RETURN(ProcessSample after_register, SampleProcess(coordinator->pid()));
  result.coordinator_rss_after_register_bytes = after_register.rss_bytes;

  jobs.Start();
  absl::SleepFor(options.warmup);

  // The measured window: /proc samples at every sub-window boundary, the
  // coordinator's /metrics at both ends.
  const int windows = std::max(1, options.windows);
  const std::chrono::nanoseconds part = absl::ToChronoNanoseconds(options.duration / windows);
  std::vector<Clock::time_point> bounds;
  std::vector<ProcessSample> coordinator_samples;
  std::vector<ProcessSample> bench_samples;
  std::vector<double> machine_busy;
  auto metrics_before = ScrapeMetrics(coordinator->metrics_port());
  const Clock::time_point window_start = Clock::now();
  // Whether the placements are bounded by free GPUs rather than by the coordinator.
  absl::Notification stop_sampling;
  ClusterOccupancy occupancy;
  std::thread sampler([&] {
    occupancy = SampleOccupancy(coordinator->metrics_port(), absl::Seconds(1), &stop_sampling);
  });
  // Also on an early return from the loop below.
  auto stop_sampler = absl::MakeCleanup([&] {
    if (!stop_sampling.HasBeenNotified()) stop_sampling.Notify();
    sampler.join();
  });
  for (int w = 0; w <= windows; ++w) {
    SleepUntil(window_start + w * part);
    bounds.push_back(Clock::now());
    ASSIGN_OR_RETURN(ProcessSample coordinator_sample, SampleProcess(coordinator->pid()));
    ASSIGN_OR_RETURN(ProcessSample bench_sample, SampleProcess(0));
    ASSIGN_OR_RETURN(double busy, MachineBusySeconds());
    machine_busy.push_back(busy);
    coordinator_samples.push_back(coordinator_sample);
    bench_samples.push_back(bench_sample);
  }
  std::move(stop_sampler).Invoke();
  result.occupancy = occupancy;
  auto metrics_after = ScrapeMetrics(coordinator->metrics_port());
  const Clock::time_point window_end = bounds.back();
  result.window_seconds = SecondsBetween(window_start, window_end);

  jobs.Stop();
  fleet.Stop();
  result.fleet = fleet.counters();
  result.jobs = jobs.counters();
  ASSIGN_OR_RETURN(ProcessSample final_sample, SampleProcess(coordinator->pid()));
  if (final_sample.exited) {
    // E.g. a leader on PostgreSQL whose lease renewal was starved steps down and exits: the
    // run measured an outage, not the coordinator; it must not count among the medians.
    auto log = ReadWholeFile(coordinator->log_path());
    std::string tail = log.ok() ? *log : std::string(log.status().message());
    if (tail.size() > 600) tail = "..." + tail.substr(tail.size() - 600);
    return absl::UnavailableError(
        absl::StrCat("the coordinator exited during the run; the end of its log:\n", tail));
  }
  result.coordinator_rss_bytes = coordinator_samples.back().rss_bytes;
  result.coordinator_peak_rss_bytes = final_sample.peak_rss_bytes;
  result.coordinator_threads = coordinator_samples.back().threads;
  if (auto stopped = coordinator->Stop(); !stopped.ok()) {
    result.notes.push_back(std::string(stopped.message()));
  }

  if (metrics_before.ok() && metrics_after.ok()) {
    result.internals = InternalsBetween(*metrics_before, *metrics_after, result.window_seconds);
    result.internals_available = true;
  } else {
    result.notes.push_back(absl::StrCat(
        "coordinator /metrics unreadable: ",
        (metrics_before.ok() ? metrics_after.status() : metrics_before.status()).message()));
  }

  auto summarize = [&](const LatencyRecorder& recorder, Clock::time_point begin,
                       Clock::time_point end) {
    std::vector<double> seconds = recorder.Between(begin, end);
    return Summarize(seconds);
  };
  const double window = result.window_seconds;
  result.heartbeat = summarize(fleet.heartbeat_latency(), window_start, window_end);
  result.health = summarize(fleet.health_latency(), window_start, window_end);
  result.report = summarize(fleet.report_latency(), window_start, window_end);
  result.submit = summarize(jobs.submit_latency(), window_start, window_end);
  result.scheduling = summarize(jobs.scheduling_latency(), window_start, window_end);
  for (int gpus : options.jobs.gpu_sizes) {
    result.scheduling_by_gpus[gpus] =
        summarize(jobs.scheduling_latency(gpus), window_start, window_end);
  }
  result.heartbeats_per_second = static_cast<double>(result.heartbeat.count) / window;
  result.jobs_submitted_per_second = static_cast<double>(result.submit.count) / window;
  result.jobs_placed_per_second = static_cast<double>(result.scheduling.count) / window;
  result.coordinator_cores =
      (coordinator_samples.back().cpu_seconds - coordinator_samples.front().cpu_seconds) / window;
  result.bench_cores =
      (bench_samples.back().cpu_seconds - bench_samples.front().cpu_seconds) / window;
  result.other_cores = std::max(0.0, (machine_busy.back() - machine_busy.front()) / window -
                                         result.coordinator_cores - result.bench_cores);

  for (int w = 0; w < windows; ++w) {
    const double seconds = SecondsBetween(bounds[w], bounds[w + 1]);
    WindowFigures figures;
    figures.heartbeat = summarize(fleet.heartbeat_latency(), bounds[w], bounds[w + 1]);
    figures.health = summarize(fleet.health_latency(), bounds[w], bounds[w + 1]);
    figures.heartbeats_per_second = static_cast<double>(figures.heartbeat.count) / seconds;
    figures.jobs_placed_per_second =
        static_cast<double>(jobs.scheduling_latency().CountBetween(bounds[w], bounds[w + 1])) /
        seconds;
    figures.coordinator_cores =
        (coordinator_samples[w + 1].cpu_seconds - coordinator_samples[w].cpu_seconds) / seconds;
    result.windows.push_back(figures);
  }
  return result;
}

}  // namespace tessera::bench
