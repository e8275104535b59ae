// CoordinatorMetrics: the coordinator's Prometheus metrics (job and node
// counts by state, GPU and CPU-slot capacity and allocation, scheduling and
// store latencies, and per-method gRPC request counts and latencies), all
// registered in the registry the daemon exposes on /metrics. Thread safety:
// every method may be called from any thread at any time (prometheus-cpp
// metrics are thread-safe); the object and its registry must outlive every
// gRPC server built with MakeInterceptorFactory().
//
// Exposed families (all names follow the Prometheus conventions and pass
// `promtool check metrics`):
//   tessera_jobs{state}                     gauge; jobs in every state, the
//                                           terminal ones included; state is
//                                           the lower-case JobState without
//                                           its prefix ("pending", ...)
//   tessera_job_oldest_pending_seconds      gauge; age of the oldest PENDING
//                                           job (0 when none waits)
//   tessera_job_failures_total{kind}        counter; jobs that ended FAILED,
//                                           by the blamed failure's kind
//   tessera_nodes{state}                    gauge; "ready", "draining", "lost"
//   tessera_gpus_capacity                   gauge; GPUs on ready nodes
//   tessera_gpus_allocated                  gauge; GPUs held by jobs
//   tessera_cpu_slots_capacity              gauge; CPU slots on ready nodes
//   tessera_cpu_slots_allocated             gauge; CPU slots held by jobs
//   tessera_scheduling_latency_seconds      histogram; submission -> SCHEDULED
//   tessera_scheduler_pass_duration_seconds histogram; one scheduler pass
//   tessera_scheduler_pass_lock_held_seconds histogram; time one pass held
//                                           the cluster lock (heartbeats wait)
//   tessera_scheduler_pass_longest_lock_hold_seconds histogram; its longest
//                                           single hold
//   tessera_scheduler_pass_phase_seconds{phase} histogram; one pass's wall time
//                                           in each phase ("list", "settle", "plan",
//                                           "schedule", "admit", "store", "count")
//   tessera_store_write_duration_seconds    histogram; one store transaction
//   tessera_store_write_cpu_seconds_total   counter; CPU time of the store's transactions
//                                           (serial: one at a time; its rate is the
//                                           share of a core the single writer uses)
//   tessera_store_writes_total              counter; writes those transactions applied
//   tessera_job_restarts_total{kind}        counter; restarts decided, by the
//                                           blamed failure's kind
//                                           ("process_exit", "node_lost", ...)
//   tessera_rank_step_seconds{job_id,rank}  gauge; a running job's rank's
//                                           busy (non-waiting) seconds per step
//   tessera_job_straggler_skew{job_id}      gauge; slowest rank's busy time
//                                           over the median (1 = even)
//   tessera_job_running{job_id}             gauge; 1 for each RUNNING job
//   tessera_job_last_step_timestamp_seconds{job_id}
//                                           gauge; unix time of a RUNNING job's
//                                           newest step metric point
//   tessera_job_last_checkpoint_timestamp_seconds{job_id}
//                                           gauge; unix time of its newest
//                                           committed checkpoint (absent
//                                           before the first)
//     These three are kept while a job stays RUNNING, stalled or not, so that
//     "no step for N minutes" can be alerted on, and removed when it leaves
//     RUNNING. They follow the job's commits (ObserveJob), not a store scan.
//   The per-job families (tessera_rank_step_seconds, tessera_job_straggler_skew and the three
//   above) are not in the registry: job_series() serves them, and the daemon registers it with
//   its exposer beside the registry (prometheus-cpp's families drop a series in time linear in
//   their size, too slow for thousands of jobs; job_series.h).
//   tessera_queue_nominal_gpus{queue}, tessera_queue_nominal_cpu_slots{queue}
//                                           gauge; a configured queue's quota
//   tessera_queue_used_gpus{queue}, tessera_queue_used_cpu_slots{queue}
//                                           gauge; devices its jobs hold
//   tessera_queue_borrowed_gpus{queue}, tessera_queue_borrowed_cpu_slots{queue}
//                                           gauge; held beyond its quota
//   tessera_queue_waiting_jobs{queue}       gauge; its jobs waiting for devices
//   tessera_queue_running_jobs{queue}       gauge; its jobs placed (scheduled,
//                                           running or being preempted)
//   tessera_queue_preemptions_total{queue,reason}
//                                           counter; its jobs preempted, by
//                                           reason ("reclaim", "priority")
//   tessera_queue_wait_seconds{queue}       histogram; entering the queue
//                                           (submission, or the previous
//                                           attempt's end) -> SCHEDULED
//   tessera_queue_fair_share{queue}         gauge; decayed dominant-resource
//                                           usage over weight (lowest borrows
//                                           first)
//   tessera_topology_domains{level}, tessera_topology_whole_free_domains{level},
//   tessera_topology_largest_free_domain_devices{level},
//   tessera_topology_free_devices{level}, tessera_topology_fragmentation{level}
//                                           gauges; per --topology_levels level:
//                                           its domains, those wholly free, the
//                                           most free devices in one, free
//                                           devices, and the share of them in
//                                           partly used domains
//   tessera_grpc_server_requests_total{method,code}
//                                           counter; finished RPCs by full
//                                           method name ("/tessera.v1.
//                                           Coordinator/SubmitJob", or
//                                           "other") and status code name
//   tessera_grpc_server_request_duration_seconds{method}
//                                           histogram; call start until the
//                                           status is sent (for streams too)
//   tessera_grpc_server_started_total{method}
//                                           counter; RPCs that reached the
//                                           coordinator (started minus
//                                           finished: the calls in flight,
//                                           e.g. waiting for the store)
// Capacity and allocation are two gauges rather than one with a label, so
// that sum() over a family stays meaningful (as in kube-state-metrics).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/service/job_series.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/node.pb.h"

namespace tessera::coordinator {

class CoordinatorMetrics {
 public:
  // Registers every family in `registry`, which must outlive this object.
  // Gauges start at 0 with every state label present.
  explicit CoordinatorMetrics(prometheus::Registry& registry);
  CoordinatorMetrics(const CoordinatorMetrics&) = delete;
  CoordinatorMetrics& operator=(const CoordinatorMetrics&) = delete;

  // Gauges set wholesale by the control loop each pass. A state missing from
  // `counts` is set to 0; the UNSPECIFIED state and unknown values are
  // ignored.
  void SetJobCounts(const std::map<v1::JobState, int64_t>& counts);
  void SetNodeCounts(const std::map<v1::NodeState, int64_t>& counts);
  void SetGpus(int64_t total, int64_t allocated);
  void SetCpuSlots(int64_t total, int64_t allocated);

  // Restarts decided since start, by blamed failure kind (cumulative; the
  // counters advance by the difference to the previous call).
  void SetRestarts(const std::map<v1::FailureKind, int64_t>& restarts);
  // Jobs that ended FAILED since start, by blamed failure kind (cumulative, as SetRestarts).
  void SetFailures(const std::map<v1::FailureKind, int64_t>& failures);
  void SetOldestPendingSeconds(double seconds);
  // The running jobs' per-rank step times and skew; series of jobs no longer
  // listed are removed.
  void SetStragglers(const std::map<std::string, v1::StragglerReport>& stragglers);
  // The configured queues' figures; gauge series of queues no longer listed are
  // removed (none exist without a queue file). Preemptions are cumulative: the
  // counters advance by the difference to the previous call, and start at 0 for
  // each reason of kPreemptionReasons.
  void SetQueues(const std::map<std::string, ClusterStats::QueueFigures>& queues);
  // Each topology level's figures (ClusterStats::topology); the levels are the coordinator's
  // and do not change while it runs.
  void SetTopology(const std::vector<TopologyLevelFigures>& levels);

  // A job as just committed (JobManager::SetCommitObserver): while it is RUNNING it has
  // tessera_job_running, and the step and checkpoint timestamps of its latest_metrics.time and
  // latest_checkpoint.create_time once it has them; any other state removes its series. One
  // job's calls must come in commit order.
  void ObserveJob(const v1::Job& job);
  // Once, at start, the jobs the store lists RUNNING (they may report nothing for a while, e.g.
  // stalled ones). A job ObserveJob saw since this object was made is skipped: its commit is
  // newer than the list.
  void SeedRunningJobs(const std::vector<v1::Job>& running);
  // What serves the per-job families; register it with the exposer that serves the registry.
  std::shared_ptr<prometheus::Collectable> job_series() const { return job_series_; }

  // Histograms, in seconds.
  // Submission -> SCHEDULED of one job (buckets 1 ms .. 1 h).
  void ObserveSchedulingLatency(double seconds);
  // One placed job's wait in `queue` (SchedulingPass::SetQueueWaitObserver; buckets 0.1 s .. 7 d).
  void ObserveQueueWait(const std::string& queue, double seconds);
  // Duration of one scheduler pass (buckets 100 us .. 10 s).
  void ObserveSchedulingPass(double seconds);
  // Of one pass: the cluster lock held in all and its longest single hold (buckets as above).
  void ObserveSchedulingPassLock(double held_seconds, double longest_hold_seconds);
  // Of one pass: the wall time of each phase it went through (ClusterStats::phase_seconds).
  void ObserveSchedulingPassPhases(const std::map<std::string, double>& phase_seconds);
  // One store transaction: its latency (buckets 100 us .. 10 s), its CPU time and its writes.
  void ObserveStoreWrite(double seconds, double cpu_seconds, int writes);

  // A gRPC server interceptor factory (for
  // ServerBuilder::experimental().SetInterceptorCreators) that counts each
  // finished call, unary or streaming, in tessera_grpc_server_requests_total
  // and observes its duration (creation of the call until its status is sent)
  // in tessera_grpc_server_request_duration_seconds. A call that ends without
  // sending a status (cancelled, server shut down) counts with code
  // "CANCELLED". A method name that no service compiled into the binary
  // declares, and that is not gRPC's own health or reflection service,
  // (clients may send any) is counted as method="other" (the value
  // gRPC's OpenTelemetry metrics, gRFC A66, use), so the series stay bounded.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeInterceptorFactory();

  // The reasons of QueueFigures::preemptions, whose counters exist from a queue's first figures.
  static constexpr std::array<const char*, 2> kPreemptionReasons = {"reclaim", "priority"};

  // The `method` label value of calls to methods no compiled-in service declares.
  static constexpr char kOtherMethod[] = "other";

  // Records one call that reached the coordinator, and one finished call; what the interceptor
  // calls.
  void RecordStart(const std::string& method);
  void RecordRequest(const std::string& method, grpc::StatusCode code, double seconds);

 private:
  // The series of one method, resolved once: Family::Add builds a metric on
  // every call before looking it up, too costly for every RPC.
  struct MethodSeries {
    prometheus::Counter* started = nullptr;
    prometheus::Histogram* duration = nullptr;
    // Index = grpc::StatusCode value (0 .. UNAUTHENTICATED); null until seen.
    std::array<prometheus::Counter*, grpc::StatusCode::UNAUTHENTICATED + 1> requests{};
  };

  // Index = enum value; index 0 (UNSPECIFIED) is left null.
  std::array<prometheus::Gauge*, v1::JobState_ARRAYSIZE> job_gauges_{};
  std::array<prometheus::Gauge*, v1::NodeState_ARRAYSIZE> node_gauges_{};
  prometheus::Gauge& gpus_capacity_;
  prometheus::Gauge& gpus_allocated_;
  prometheus::Gauge& cpu_slots_capacity_;
  prometheus::Gauge& cpu_slots_allocated_;
  prometheus::Histogram& scheduling_latency_;
  prometheus::Histogram& scheduler_pass_duration_;
  prometheus::Histogram& scheduler_pass_lock_held_;
  prometheus::Histogram& scheduler_pass_longest_lock_hold_;
  prometheus::Histogram& store_write_duration_;
  prometheus::Counter& store_write_cpu_seconds_;
  prometheus::Counter& store_writes_;
  prometheus::Family<prometheus::Histogram>& scheduler_pass_phases_;
  prometheus::Family<prometheus::Counter>& grpc_requests_;
  prometheus::Family<prometheus::Histogram>& grpc_request_duration_;
  prometheus::Family<prometheus::Counter>& grpc_started_;
  prometheus::Family<prometheus::Counter>& restarts_;
  prometheus::Family<prometheus::Counter>& failures_;
  prometheus::Gauge& oldest_pending_;
  const std::shared_ptr<JobSeries> job_series_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, MethodSeries> methods_ ABSL_GUARDED_BY(mu_);
  std::map<v1::FailureKind, int64_t> restarts_seen_ ABSL_GUARDED_BY(mu_);
  std::map<v1::FailureKind, int64_t> failures_seen_ ABSL_GUARDED_BY(mu_);
  // Until SeedRunningJobs: the jobs ObserveJob has seen, whose listed copies are older.
  bool seeded_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> observed_before_seed_ ABSL_GUARDED_BY(mu_);
  void ApplyJobLocked(const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `method`'s series (unknown names share kOtherMethod's), and its label.
  std::pair<const std::string*, MethodSeries*> MethodLocked(const std::string& method)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // phase -> its tessera_scheduler_pass_phase_seconds series.
  std::map<std::string, prometheus::Histogram*> phase_series_ ABSL_GUARDED_BY(mu_);
  // The tessera_queue_* families, in QueueSeries order, and each queue's series.
  static constexpr int kQueueFamilies = 9;
  std::array<prometheus::Family<prometheus::Gauge>*, kQueueFamilies> queue_families_{};
  std::map<std::string, std::array<prometheus::Gauge*, kQueueFamilies>> queue_series_
      ABSL_GUARDED_BY(mu_);
  prometheus::Family<prometheus::Counter>* queue_preemptions_ = nullptr;
  // The tessera_topology_* families (domains, whole free domains, largest free domain, free
  // devices, fragmentation) and each level's series.
  static constexpr int kTopologyFamilies = 5;
  std::array<prometheus::Family<prometheus::Gauge>*, kTopologyFamilies> topology_families_{};
  std::map<std::string, std::array<prometheus::Gauge*, kTopologyFamilies>> topology_series_
      ABSL_GUARDED_BY(mu_);
  // (queue, reason) -> the cumulative count of the previous SetQueues.
  std::map<std::pair<std::string, std::string>, int64_t> preemptions_seen_ ABSL_GUARDED_BY(mu_);
  prometheus::Family<prometheus::Histogram>* queue_wait_ = nullptr;
  // queue -> its tessera_queue_wait_seconds series.
  std::map<std::string, prometheus::Histogram*> queue_wait_series_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::coordinator
