// The scheduling pass's own clocks for its statistics (ClusterStats::lock_held_seconds,
// phase_seconds): TimedLock holds a mutex for one phase and adds the time held; PhaseTimer adds
// the wall time of each phase. Steady-clock time of this process: what the pass costs, not the
// cluster's time (ClusterOptions::clock), which tests simulate.
//
// Thread safety: each object belongs to the one pass that made it.
#pragma once

#include <algorithm>
#include <chrono>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/cluster/cluster_state.h"

namespace tessera::coordinator {

class ABSL_SCOPED_LOCKABLE TimedLock {
 public:
  TimedLock(absl::Mutex* mu, ClusterStats* stats) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu)
      : lock_(mu), stats_(stats), start_(std::chrono::steady_clock::now()) {}
  ~TimedLock() ABSL_UNLOCK_FUNCTION() {
    const double held =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    stats_->lock_held_seconds += held;
    stats_->longest_lock_hold_seconds = std::max(stats_->longest_lock_hold_seconds, held);
  }
  TimedLock(const TimedLock&) = delete;
  TimedLock& operator=(const TimedLock&) = delete;

 private:
  absl::MutexLock lock_;
  ClusterStats* stats_;
  std::chrono::steady_clock::time_point start_;
};

// Adds the wall time from its construction (or the previous Next) to stats->phase_seconds[phase].
class PhaseTimer {
 public:
  explicit PhaseTimer(ClusterStats* stats)
      : stats_(stats), start_(std::chrono::steady_clock::now()) {}
  void Next(const char* phase) {
    const auto now = std::chrono::steady_clock::now();
    stats_->phase_seconds[phase] += std::chrono::duration<double>(now - start_).count();
    start_ = now;
  }

 private:
  ClusterStats* stats_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tessera::coordinator
