// One scale of the control-plane benchmark: a fresh coordinator process, a
// simulated fleet of N nodes and a stream of jobs against it, measured over
// a window cut into equal sub-windows (the repeats behind each range).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/control_plane_fleet.h"
#include "bench/control_plane_jobs.h"
#include "bench/control_plane_stats.h"

namespace tessera::bench {

struct ScaleOptions {
  // What the run is called in the results (control_plane_queues.h's scenarios).
  std::string scenario = "single-pool";
  // The coordinator's queue file (written to its state directory); empty: none, one pool.
  std::string queue_file_yaml;
  // The store's backend, kSqliteBackend or kPostgresBackend (control_plane_backends.h).
  std::string backend = "sqlite";
  // The coordinator's --state for PostgreSQL (a fresh database) and its password file; empty:
  // a SQLite file in the run's state directory.
  std::string state_url;
  std::string database_password_file;
  // Path of tessera-coordinator.
  std::string coordinator_binary;
  // A fresh directory for the coordinator's state is made under it.
  std::string work_dir;
  // Keep the state directory (SQLite file, log) after the run.
  bool keep_state = false;
  absl::Duration coordinator_heartbeat_timeout = absl::Seconds(15);
  // fleet.nodes is the scale.
  FleetOptions fleet;
  JobStreamOptions jobs;
  // How long the whole fleet may take to register.
  absl::Duration register_timeout = absl::Seconds(120);
  // Jobs flow this long before measuring starts.
  absl::Duration warmup = absl::Seconds(5);
  // The measured window, cut into `windows` equal parts.
  absl::Duration duration = absl::Seconds(20);
  int windows = 4;
};

// Figures of one sub-window.
struct WindowFigures {
  LatencySummary heartbeat;
  LatencySummary health;
  double heartbeats_per_second = 0;
  double jobs_placed_per_second = 0;
  double coordinator_cores = 0;
};

// What the coordinator's own /metrics said over the measured window.
struct CoordinatorInternals {
  // Scheduler passes (Cluster::Tick) per second, their mean duration, and the
  // share of the window spent in them.
  double passes_per_second = 0;
  double mean_pass_seconds = 0;
  double pass_duty = 0;
  // Of those passes: the cluster lock held per pass (mean), the longest single
  // hold per pass (mean) and the share of the window under the lock. A
  // coordinator without the lock histograms held the lock for whole passes.
  double mean_lock_held_seconds = 0;
  double mean_longest_lock_hold_seconds = 0;
  double lock_duty = 0;
  // Seconds per pass (all passes counted) in each of its phases
  // (tessera_scheduler_pass_phase_seconds), in the pass's order; empty for a
  // coordinator without that histogram.
  std::vector<std::pair<std::string, double>> pass_phase_seconds;
  // SQLite write transactions per second and their mean duration.
  double store_writes_per_second = 0;
  double mean_store_write_seconds = 0;
  // The store's writer (tessera_store_write_cpu_seconds_total, tessera_store_writes_total):
  // its CPU in cores (serial: 1 is all it can do), and its CPU per write; 0 for a coordinator
  // without those counters.
  double store_writer_cores = 0;
  double store_cpu_per_write_seconds = 0;
  // Server-side mean durations (interceptor: call start to status sent).
  double mean_heartbeat_seconds = 0;
  double mean_health_seconds = 0;
  double mean_submit_seconds = 0;
  // The coordinator's own submission-to-SCHEDULED latency, mean.
  double mean_submit_to_scheduled_seconds = 0;
  double jobs_scheduled_per_second = 0;
};

// The cluster as the coordinator's gauges said it, scraped about once a second over the
// measured window (the gauges change once a second, at the pass that counts).
struct ClusterOccupancy {
  // Scrapes that had the gauges.
  int samples = 0;
  // tessera_gpus_allocated / tessera_gpus_capacity.
  Spread gpus_allocated_share;
  double mean_gpus_allocated_share = 0;
  // tessera_jobs{state="pending"}: submitted jobs not yet placed.
  Spread pending_jobs;
  double mean_pending_jobs = 0;
};

struct ScaleResult {
  std::string scenario;
  // ScaleOptions::backend.
  std::string backend = "sqlite";
  int nodes = 0;
  double offered_jobs_per_second = 0;
  double window_seconds = 0;
  // Joining: wall time until every node registered, and RegisterNode
  // round trips.
  double register_seconds = 0;
  int registered = 0;
  LatencySummary register_latency;
  // Over the whole measured window.
  LatencySummary heartbeat;
  LatencySummary health;
  LatencySummary submit;
  LatencySummary scheduling;
  std::map<int, LatencySummary> scheduling_by_gpus;
  LatencySummary report;
  double heartbeats_per_second = 0;
  double heartbeats_expected_per_second = 0;
  double jobs_submitted_per_second = 0;
  double jobs_placed_per_second = 0;
  double coordinator_cores = 0;
  double bench_cores = 0;
  // Cores busy with anything else on the machine during the window (other
  // builds, say); large values mean the figures above are CPU-starved.
  double other_cores = 0;
  int64_t coordinator_rss_bytes = 0;
  int64_t coordinator_peak_rss_bytes = 0;
  int64_t coordinator_rss_after_register_bytes = 0;
  int coordinator_threads = 0;
  CoordinatorInternals internals;
  bool internals_available = false;
  ClusterOccupancy occupancy;
  std::vector<WindowFigures> windows;
  FleetCounters fleet;
  JobStreamCounters jobs;
  // Non-fatal trouble worth printing (a failed scrape, a slow stop).
  std::vector<std::string> notes;
};

// Runs one scale. Errors only when the coordinator cannot be started or
// sampled; trouble during the run shows in the counters and notes.
absl::StatusOr<ScaleResult> RunScale(const ScaleOptions& options);

}  // namespace tessera::bench
