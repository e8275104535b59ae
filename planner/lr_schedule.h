// The learning-rate schedule of a job: linear warmup from 0 to the peak, then
// cosine decay to min_lr_ratio * peak, then flat. Pure function of the step,
// so a resumed run continues the same curve.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "tessera/v1/job.pb.h"

namespace tessera::planner {

// Learning rate for optimizer step `step` (1-based: the first step is 1) of a
// job of `max_steps` steps. decay_steps 0 means max_steps.
double LearningRateAt(const v1::LearningRateSchedule& schedule, int64_t max_steps, int64_t step);

// INVALID_ARGUMENT naming the field for a schedule that cannot run.
absl::Status ValidateSchedule(const v1::LearningRateSchedule& schedule, int64_t max_steps);

}  // namespace tessera::planner
