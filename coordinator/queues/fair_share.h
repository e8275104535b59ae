// Fair share: how much each queue has used lately, so that capacity a cohort lends goes to the
// queue that has had least of it. Usage is device-seconds with exponential decay (Slurm's
// fair-share usage with a half-life): what a queue used one half-life ago counts half as much as
// what it uses now. Pure logic on explicit times: the caller passes the time of each observation
// (the coordinator its Clock's, tests a simulated one).
//
// A queue's share is its dominant resource share (DRF) divided by its weight:
//   share = max(gpu_seconds / cohort_gpus, cpu_slot_seconds / cohort_cpu_slots) / weight
// where gpu_seconds and cpu_slot_seconds are decayed usage and cohort_* the sum of the nominal
// quotas of the queue's cohort (its own nominal without a cohort); a resource the cohort has
// none of is left out. Shares compare queues of one cohort; across cohorts they mean nothing.
//
// Thread safety: none; the owner serializes calls (the coordinator holds it under its pass lock).
#pragma once

#include <map>
#include <string>

#include "absl/time/time.h"
#include "coordinator/queues/queue_config.h"

namespace tessera::coordinator {

// Decayed usage of one queue as of the tracker's last observation, in device-seconds.
struct DecayedUsage {
  double gpu_seconds = 0;
  double cpu_slot_seconds = 0;
};

class FairShareTracker {
 public:
  // Observations start at `start`; nothing has been used before it.
  FairShareTracker(absl::Duration half_life, absl::Time start);

  // Accounts what each queue held from the previous observation (or `start`) until `now`:
  // `held` must be what the queues held throughout that interval (queues absent held nothing).
  // Call it whenever holdings change (a job starts or ends) and before reading shares. Usage is
  // integrated exactly under the decay, so the result does not depend on how often it is called.
  // A `now` before the previous observation changes nothing (time never goes back).
  void Accrue(absl::Time now, const std::map<std::string, Resources>& held);

  // Applies from the next Accrue on; decay so far stays as it was computed.
  void set_half_life(absl::Duration half_life) { half_life_ = half_life; }
  absl::Duration half_life() const { return half_life_; }
  absl::Time last_observation() const { return last_; }

  // Decayed usage as of last_observation(); zero for a queue never seen.
  DecayedUsage Usage(const std::string& queue) const;

  // share (above) of `queue` under `config`; 0 for a queue not in config.
  double Share(const QueueConfig& config, const std::string& queue) const;
  // Share of every queue of `config`.
  std::map<std::string, double> Shares(const QueueConfig& config) const;

  // Every queue's decayed usage, for saving across restarts; Restore puts it back.
  const std::map<std::string, DecayedUsage>& usage() const { return usage_; }
  void Restore(absl::Time as_of, std::map<std::string, DecayedUsage> usage);

 private:
  absl::Duration half_life_;
  absl::Time last_;
  std::map<std::string, DecayedUsage> usage_;
};

}  // namespace tessera::coordinator
