// The chaos soak (`make chaos`): a cluster on isolated networks (chaos_cluster.h)
// trains a stream of small CPU jobs while faults are injected at random, from one seed:
//   - kill_trainer: kill -9 of one trainer process;
//   - kill_worker: kill -9 of a worker daemon, restarted a few seconds later;
//   - kill_coordinator: kill -9 of the leading coordinator (with PostgreSQL HA), restarted as a
//     standby a few seconds later;
//   - partition_coordinator: a worker cut off from the coordinators for 2-20 s (longer than the
//     heartbeat timeout or not);
//   - partition_workers: two workers cut off from each other for 2-20 s;
//   - packet_loss: 2-10% of a worker's packets dropped for 5-20 s;
//   - latency: 50-300 ms (plus up to a fifth of it in jitter) added each way to all of a
//     worker's packets for 5-20 s (NetnsLab::Delay).
// When the time is up the network heals, every daemon comes back, and the soak waits for every
// job to end, then checks what the issue asks: every job SUCCEEDED or FAILED with its cause named
// (anything else is "lost"); no trainer process left on any host; every committed checkpoint
// verifies (manifest, sizes and XXH3 digests), and every checkpoint the coordinator recorded is
// among them; every SUCCEEDED job's metrics hold each step from 1 to max_steps (a step missing
// is a report lost); and for a sample of the SUCCEEDED jobs that trained at their spec's world
// size throughout (those restarted most first), the losses of a fault-free rerun with the same
// spec and seed equal the faulted run's at every step it reported.
//
// Thread safety: RunChaosSoak runs on the calling thread and starts none of its own.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace tessera::chaos {

struct SoakOptions {
  // How long faults are injected (the drain and the checks come after).
  absl::Duration duration = absl::Minutes(15);
  // Seed of every random choice; 0 picks one from the clock (printed, to replay a failure).
  uint64_t seed = 0;
  std::string bin_dir;
  std::string corpus;
  // Where the soak's files go; empty: a fresh directory under /tmp, removed after a clean run.
  std::string dir;
  int workers = 3;
  // Two coordinators on a private PostgreSQL when its server binaries are installed; false (or
  // no PostgreSQL): one coordinator on SQLite, and no kill_coordinator faults.
  bool ha = true;
  // With ha: fail (FAILED_PRECONDITION) rather than run on SQLite when PostgreSQL is absent.
  bool require_ha = false;
  // Each job trains a number of steps drawn from [min_job_steps, max_job_steps] in tens.
  int min_job_steps = 200;
  int max_job_steps = 500;
  // Jobs kept submitted and unfinished at a time.
  int jobs_in_flight = 2;
  // Mean seconds between two faults (drawn uniformly from [0.5, 1.5] times it).
  double mean_fault_interval_s = 6;
  // SUCCEEDED jobs rerun fault-free to compare losses.
  int loss_checks = 3;
  // How long the drain may take before unfinished jobs count as lost.
  absl::Duration drain_timeout = absl::Minutes(6);
};

// Runs the soak and returns its counts as JSON (see the .cc for the fields); "passed" is true
// when nothing was lost, orphaned, corrupt or unequal. An error when the cluster cannot be built
// (FAILED_PRECONDITION when not root, without ip/iptables, or without PostgreSQL when
// require_ha).
absl::StatusOr<nlohmann::json> RunChaosSoak(const SoakOptions& options);

}  // namespace tessera::chaos
