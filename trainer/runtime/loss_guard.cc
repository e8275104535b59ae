#include "trainer/runtime/loss_guard.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"

namespace tessera::trainer {
namespace {

double Median(const std::deque<double>& values) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

}  // namespace

LossGuard::LossGuard(const v1::GuardSpec& spec)
    : loss_factor_(spec.loss_spike_factor()),
      grad_norm_factor_(spec.grad_norm_spike_factor()),
      window_(spec.window() > 0 ? spec.window() : kDefaultGuardWindow) {}

std::optional<v1::LossSpike> LossGuard::Check(int64_t step, double loss, double grad_norm) const {
  v1::LossSpike spike;
  spike.set_step(step);
  spike.set_loss(loss);
  spike.set_grad_norm(grad_norm);
  const bool full = size() >= window_;
  if (full) {
    spike.set_loss_median(Median(losses_));
    spike.set_grad_norm_median(Median(grad_norms_));
  }
  if (!std::isfinite(loss)) {
    spike.set_cause(absl::StrFormat("loss is %g at step %d", loss, step));
    return spike;
  }
  if (!std::isfinite(grad_norm)) {
    spike.set_cause(absl::StrFormat("gradient norm is %g at step %d", grad_norm, step));
    return spike;
  }
  if (!full) return std::nullopt;
  if (loss_factor_ > 0 && loss > loss_factor_ * spike.loss_median()) {
    spike.set_cause(absl::StrFormat("loss %.4g at step %d > %g x median %.4g of the last %d steps",
                                    loss, step, loss_factor_, spike.loss_median(), window_));
    return spike;
  }
  if (grad_norm_factor_ > 0 && grad_norm > grad_norm_factor_ * spike.grad_norm_median()) {
    spike.set_cause(
        absl::StrFormat("gradient norm %.4g at step %d > %g x median %.4g of the last %d steps",
                        grad_norm, step, grad_norm_factor_, spike.grad_norm_median(), window_));
    return spike;
  }
  return std::nullopt;
}

void LossGuard::Accept(double loss, double grad_norm) {
  losses_.push_back(loss);
  grad_norms_.push_back(grad_norm);
  while (size() > window_) {
    losses_.pop_front();
    grad_norms_.pop_front();
  }
}

int64_t BatchesSkippedAt(const v1::GuardSpec& spec, int64_t step) {
  int64_t batches = 0;
  for (const v1::SkippedBatches& skipped : spec.skipped()) {
    if (skipped.step() == step) batches += skipped.batches();
  }
  return batches;
}

int64_t BatchIndexOfStep(const v1::GuardSpec& spec, int64_t step) {
  int64_t index = step - 1;
  for (const v1::SkippedBatches& skipped : spec.skipped()) {
    if (skipped.step() <= step) index += skipped.batches();
  }
  return index;
}

}  // namespace tessera::trainer
