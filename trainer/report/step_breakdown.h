// Arithmetic and text of StepTimeBreakdown (proto/tessera/v1/metrics.proto): sums and means over
// steps (a heartbeat carries the mean since the previous one) and the compact summary of the
// trainer's step log line. Pure functions of protos.
#pragma once

#include <string>

#include "tessera/v1/metrics.pb.h"

namespace tessera::trainer {

// Adds `step` into `*sum`: phases add, collectives add per (kind, dim) (calls and bytes too).
void AddBreakdown(const v1::StepTimeBreakdown& step, v1::StepTimeBreakdown* sum);

// `sum` divided by `steps` (phases, collective seconds, calls and bytes, the counts rounded), the
// collectives largest first; empty when `steps` <= 0.
v1::StepTimeBreakdown MeanBreakdown(const v1::StepTimeBreakdown& sum, int64_t steps);

// Sorts the collectives by seconds, largest first (ties by kind and dim, for stable output).
void SortCollectives(v1::StepTimeBreakdown* breakdown);

// "fwd 41% bwd 38% opt 6% data 1% ckpt 0% other 14% | all_reduce/dp 12% all_gather/tp 3%":
// each phase's and each collective's share of `wall_seconds` (the collectives overlap the
// phases), at most `max_collectives` of them; "" when wall_seconds <= 0.
std::string BreakdownSummary(const v1::StepTimeBreakdown& breakdown, double wall_seconds,
                             int max_collectives = 4);

}  // namespace tessera::trainer
