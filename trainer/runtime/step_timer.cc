#include "trainer/runtime/step_timer.h"

#include <algorithm>

#include "trainer/report/step_breakdown.h"

namespace tessera::trainer {

StepTimer::StepTimer(bool enabled) : enabled_(enabled) { SetCollectiveTimingEnabled(enabled); }

void StepTimer::StartStep() {
  phase_seconds_.fill(0);
  if (enabled_) collectives_at_start_ = CollectiveSnapshot();
}

void StepTimer::Add(StepPhase phase, double seconds) {
  phase_seconds_[static_cast<int>(phase)] += seconds;
}

StepTimer::Scope::Scope(StepTimer& timer, StepPhase phase) : timer_(timer), phase_(phase) {
  if (timer_.enabled_) start_ = std::chrono::steady_clock::now();
}

StepTimer::Scope::~Scope() {
  if (!timer_.enabled_) return;
  timer_.Add(phase_,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
}

v1::StepTimeBreakdown StepTimer::FinishStep(double wall_seconds,
                                            double checkpoint_blocked_seconds) {
  v1::StepTimeBreakdown breakdown;
  if (!enabled_) return breakdown;
  const auto seconds = [&](StepPhase phase) { return phase_seconds_[static_cast<int>(phase)]; };
  breakdown.set_forward_seconds(seconds(StepPhase::kForward));
  breakdown.set_backward_seconds(seconds(StepPhase::kBackward));
  breakdown.set_optimizer_seconds(seconds(StepPhase::kOptimizer));
  breakdown.set_data_wait_seconds(seconds(StepPhase::kDataWait));
  breakdown.set_checkpoint_blocked_seconds(checkpoint_blocked_seconds);
  double phases = checkpoint_blocked_seconds;
  for (double s : phase_seconds_) phases += s;
  breakdown.set_other_seconds(std::max(0.0, wall_seconds - phases));
  // CUDA collectives whose events completed by now count in this step (most were issued in the
  // previous one): reading them never waits for the device.
  PollCollectiveEvents();
  const CollectiveTable now = CollectiveSnapshot();
  for (int kind = 0; kind < kCollectiveKinds; ++kind) {
    for (int dim = 0; dim < kCollectiveDims; ++dim) {
      const int i = CollectiveIndex(static_cast<CollectiveKind>(kind), dim);
      const int64_t calls = now[i].calls - collectives_at_start_[i].calls;
      if (calls <= 0) continue;
      v1::CollectiveTime* c = breakdown.add_collectives();
      c->set_kind(CollectiveKindName(static_cast<CollectiveKind>(kind)));
      c->set_dim(CollectiveDimName(dim));
      c->set_seconds(static_cast<double>(now[i].nanos - collectives_at_start_[i].nanos) * 1e-9);
      c->set_calls(calls);
      c->set_bytes(now[i].bytes - collectives_at_start_[i].bytes);
      c->set_peer_wait_seconds(
          static_cast<double>(now[i].peer_wait_nanos - collectives_at_start_[i].peer_wait_nanos) *
          1e-9);
    }
  }
  SortCollectives(&breakdown);
  collectives_at_start_ = now;
  return breakdown;
}

}  // namespace tessera::trainer
