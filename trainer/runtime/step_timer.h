// Where one rank's step time goes: host wall time of the step's phases (forward,
// backward, optimizer, data wait) as the training loop marks them, and the collectives' time by
// kind and mesh dimension from the process-wide table of trainer/parallel/collective_timer.h,
// read as the difference between the step's start and its end. FinishStep turns them into the
// StepTimeBreakdown of proto/tessera/v1/metrics.proto: checkpoint_blocked as the loop measured
// it, other = wall - the phases, so that the phases and other add up to the step's wall time.
//
// On CUDA the phases are host time (kernel launches; the device catches up where the host waits,
// e.g. the loss's .item(), which lands in other), while collectives are CUDA-event time read one
// step late (PollCollectiveEvents).
//
// Thread safety: one thread (the training loop) drives a StepTimer. The collective table it reads
// is process-wide: with several ranks as threads of one process it holds their sum.
#pragma once

#include <array>
#include <chrono>

#include "tessera/v1/metrics.pb.h"
#include "trainer/parallel/collective_timer.h"

namespace tessera::trainer {

enum class StepPhase { kForward = 0, kBackward = 1, kOptimizer = 2, kDataWait = 3 };

class StepTimer {
 public:
  // Disabled, it measures nothing (scopes read no clock) and turns collective timing off
  // process-wide; FinishStep then returns an empty breakdown.
  explicit StepTimer(bool enabled);

  bool enabled() const { return enabled_; }

  // A step starts: the phases restart from zero and the collective table is read.
  void StartStep();
  void Add(StepPhase phase, double seconds);

  // Adds the time from its construction to its destruction to a phase.
  class Scope {
   public:
    Scope(StepTimer& timer, StepPhase phase);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StepTimer& timer_;
    const StepPhase phase_;
    std::chrono::steady_clock::time_point start_;
  };

  // The step ended after `wall_seconds`, `checkpoint_blocked_seconds` of which were blocked by
  // checkpointing outside the phases. other_seconds is what the phases leave of the wall time
  // (never negative); the collectives are those recorded since StartStep, largest first.
  v1::StepTimeBreakdown FinishStep(double wall_seconds, double checkpoint_blocked_seconds);

 private:
  const bool enabled_;
  std::array<double, 4> phase_seconds_{};
  CollectiveTable collectives_at_start_{};
};

}  // namespace tessera::trainer
