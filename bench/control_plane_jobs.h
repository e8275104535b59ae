// JobStream: submits training jobs of mixed sizes to a coordinator at a
// steady rate through tessera.v1.Coordinator/SubmitJob, and times each from
// the moment SubmitJob returned until every one of its ranks has reached a
// simulated worker in a heartbeat response (SimulatedFleet reports the
// deliveries). That span is what a user waits before the gang can start:
// the scheduler's next pass plus the wait for each node's next heartbeat.
//
// Thread safety: Start/Stop from one thread; OnDelivered from any thread;
// recorders and counters are thread-safe. One absl::Mutex guards the jobs
// being tracked.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "bench/control_plane_stats.h"
#include "grpcpp/channel.h"
#include "tessera/v1/coordinator_service.grpc.pb.h"

namespace tessera::bench {

struct JobStreamOptions {
  // Submissions per second, spaced evenly.
  double jobs_per_second = 5;
  // GPUs per job (each an explicit data-parallel layout of that world size)
  // and the relative weight of each size in the mix.
  std::vector<int> gpu_sizes = {1, 8, 16, 64};
  std::vector<double> weights = {4, 3, 2, 1};
  // A submission is skipped (and counted) while this many SubmitJob calls
  // are in flight, or this many submitted jobs still wait for their ranks:
  // the backlog stays bounded when the coordinator cannot keep up.
  int max_submits_in_flight = 64;
  int max_backlog = 2000;
  // Deadline of every call.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Seed of the size mix, so runs submit the same sequence.
  uint64_t seed = 1;
  // Queues the jobs are submitted to (JobSpec.queue), each job's drawn by `queue_weights` from
  // a generator of its own, so the sizes are the same with and without queues. Empty: none named.
  std::vector<std::string> queues;
  std::vector<double> queue_weights;
};

// Running totals since Start().
struct JobStreamCounters {
  int64_t submitted = 0;
  int64_t submit_failures = 0;
  // Slots skipped because of max_submits_in_flight / max_backlog.
  int64_t skipped_in_flight = 0;
  int64_t skipped_backlog = 0;
  // Jobs whose every rank was delivered.
  int64_t delivered = 0;
  // Submitted jobs still waiting for some rank.
  int64_t backlog = 0;
  std::string first_error;
};

// A valid spec for a GPT-2 124M job on `gpus` H100s, data parallel only, in `queue` (empty: the
// submitter's default).
v1::JobSpec BenchJobSpec(int gpus, int64_t sequence, const std::string& queue = "");

class JobStream {
 public:
  JobStream(std::shared_ptr<grpc::Channel> channel, JobStreamOptions options);
  // Stops (see Stop()).
  ~JobStream();
  JobStream(const JobStream&) = delete;
  JobStream& operator=(const JobStream&) = delete;

  void Start();
  // Stops submitting and waits for the submissions in flight. Idempotent.
  void Stop();

  // A SimulatedFleet DeliveryObserver.
  void OnDelivered(const std::string& job_id, int ranks, int world_size, Clock::time_point at);

  // SubmitJob round trips, stamped at their return.
  const LatencyRecorder& submit_latency() const { return submit_latency_; }
  // SubmitJob's return to the delivery of the last rank, stamped at that
  // delivery; overall and by job size (GPUs).
  const LatencyRecorder& scheduling_latency() const { return scheduling_latency_; }
  const LatencyRecorder& scheduling_latency(int gpus) const;
  JobStreamCounters counters() const;

 private:
  struct Tracked {
    int gpus = 0;
    // Unset until SubmitJob returns; a delivery may come first.
    std::optional<Clock::time_point> submitted;
    int ranks_delivered = 0;
    int world_size = 0;
    Clock::time_point last_delivery;
  };

  void SubmitLoop();
  void Submit(int gpus, int64_t sequence, const std::string& queue);
  // Records the job's latency and forgets it once it is both submitted and
  // fully delivered. Caller holds mu_.
  void SettleLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobStreamOptions options_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  LatencyRecorder submit_latency_;
  LatencyRecorder scheduling_latency_;
  std::map<int, LatencyRecorder> latency_by_size_;

  mutable absl::Mutex mu_;
  std::map<std::string, Tracked> tracked_ ABSL_GUARDED_BY(mu_);
  int64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  std::string first_error_ ABSL_GUARDED_BY(mu_);

  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> submitted_{0};
  std::atomic<int64_t> submit_failures_{0};
  std::atomic<int64_t> skipped_in_flight_{0};
  std::atomic<int64_t> skipped_backlog_{0};

  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace tessera::bench
