// LossGuard: the trainer's half of the loss-spike guard (JobSpec.guard). It keeps the losses and
// gradient norms of the attempt's last `window` good steps and judges each new step against their
// medians: a loss above loss_spike_factor x the median loss, a gradient norm above
// grad_norm_spike_factor x the median norm, or a NaN/Inf in either is a spike. A spike's update is
// never applied and the attempt ends so that the coordinator rolls the job back
// (docs/loss-guard.md). Also the data the guard skips: which global batches a step discards
// before drawing its own (GuardSpec.skipped).
//
// Medians, not means: a window that already holds one high step (just under the factor) would
// lift a mean and hide the next spike, and one NaN-free but huge outlier would do the same for
// many steps after it; the median ignores both. The window starts empty on every attempt (it is
// not checkpointed), so the relative checks resume `window` steps after a restart; NaN/Inf are
// caught from the first step.
//
// Thread safety: none; the training thread owns it. Pure C++ (no LibTorch) so that the
// detector is tested without a device.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>

#include "tessera/v1/job.pb.h"

namespace tessera::trainer {

// GuardSpec.window when 0.
inline constexpr int kDefaultGuardWindow = 20;

class LossGuard {
 public:
  explicit LossGuard(const v1::GuardSpec& spec);

  // The verdict on optimizer step `step` (from 1) with the step's loss (averaged over ranks) and
  // global gradient norm before clipping: nullopt for a good step, else the spike with its cause
  // and the window's medians. Changes nothing: Accept() adds a good step.
  std::optional<v1::LossSpike> Check(int64_t step, double loss, double grad_norm) const;
  // Adds a good step's figures to the window (the oldest leaves a full one).
  void Accept(double loss, double grad_norm);

  // Good steps in the window now.
  int size() const { return static_cast<int>(losses_.size()); }
  int window() const { return window_; }

 private:
  double loss_factor_;
  double grad_norm_factor_;
  int window_;
  std::deque<double> losses_;
  std::deque<double> grad_norms_;
};

// Global batches step `step` (from 1) discards before drawing its own: the sum of the skipped
// ranges at that step.
int64_t BatchesSkippedAt(const v1::GuardSpec& spec, int64_t step);
// The index (from 0) in the loader's sequence of the global batch step `step` trains on: step - 1
// plus every batch skipped at or before it.
int64_t BatchIndexOfStep(const v1::GuardSpec& spec, int64_t step);

}  // namespace tessera::trainer
