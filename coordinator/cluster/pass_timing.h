// The scheduling pass's own clock for its statistics (ClusterStats::phase_seconds): PhaseTimer
// adds the wall time of each phase (GuardedLedger::Hold adds the time the cluster lock is held).
// Steady-clock time of this process: what the pass costs, not the cluster's time
// (ClusterOptions::clock), which tests simulate.
//
// Thread safety: each object belongs to the one pass that made it.
#pragma once

#include <chrono>

#include "coordinator/cluster/cluster_state.h"

namespace tessera::coordinator {

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
