#include "planner/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace tessera::planner {

double LearningRateAt(const v1::LearningRateSchedule& schedule, int64_t max_steps, int64_t step) {
  const double peak = schedule.peak_learning_rate();
  const int64_t warmup = schedule.warmup_steps();
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  const int64_t decay_end = schedule.decay_steps() > 0 ? schedule.decay_steps() : max_steps;
  const double floor = peak * schedule.min_lr_ratio();
  if (step >= decay_end || decay_end <= warmup) return floor;
  double progress = static_cast<double>(step - warmup) / static_cast<double>(decay_end - warmup);
  double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return floor + (peak - floor) * cosine;
}

absl::Status ValidateSchedule(const v1::LearningRateSchedule& schedule, int64_t max_steps) {
  if (!(schedule.peak_learning_rate() > 0) || !std::isfinite(schedule.peak_learning_rate())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.schedule.peak_learning_rate: must be > 0, got ", schedule.peak_learning_rate()));
  }
  if (schedule.warmup_steps() < 0) {
    return absl::InvalidArgumentError("optimizer.schedule.warmup_steps: must be >= 0");
  }
  if (schedule.min_lr_ratio() < 0 || schedule.min_lr_ratio() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer.schedule.min_lr_ratio: must be in [0, 1], got ", schedule.min_lr_ratio()));
  }
  if (schedule.decay_steps() < 0) {
    return absl::InvalidArgumentError("optimizer.schedule.decay_steps: must be >= 0");
  }
  if (max_steps <= 0) return absl::InvalidArgumentError("max_steps: must be > 0");
  return absl::OkStatus();
}

}  // namespace tessera::planner
