// The training settings a job spec leaves open, resolved in one place: the seed, the
// initialisation's standard deviation, AdamW's betas and epsilon, clipping, evaluation batches and
// the precision. The coordinator resolves them once, at submission, into LayoutPlan.settings and
// LayoutPlan.precision; the trainer reads them from its task's plan and calls these only for a
// task that does not carry them (one written by hand, or a plan stored before they were
// resolved). Pure functions; thread-safe.
#pragma once

#include <cstdint>

#include "tessera/v1/job.pb.h"
#include "tessera/v1/layout.pb.h"

namespace tessera::planner {

// The seed of initialisation and data order when a spec leaves JobSpec.seed at 0.
inline constexpr uint64_t kDefaultSeed = 1234;
inline uint64_t EffectiveSeed(uint64_t seed) { return seed != 0 ? seed : kDefaultSeed; }

// AdamW's defaults when OptimizerSpec leaves them at 0.
inline constexpr double kDefaultAdamBeta1 = 0.9;
inline constexpr double kDefaultAdamBeta2 = 0.95;
inline constexpr double kDefaultAdamEpsilon = 1e-8;
// Batches per evaluation when DataSpec.eval_batches is 0.
inline constexpr int kDefaultEvalBatches = 20;

// `spec`'s settings with every default filled in. The spec must have passed validation (the
// coordinator's ValidateJobSpec refuses negative values); nothing is checked here.
v1::TrainingSettings ResolveTrainingSettings(const v1::JobSpec& spec);

// The precision a job trains in: the requested one, or BF16 on GPUs and FP32 on CPUs when the
// spec leaves it unspecified.
v1::Precision ResolvePrecision(v1::Precision requested, bool gpus);

// Whether `settings` were resolved (a plan stored before settings were resolved at submission
// carries none).
bool HasTrainingSettings(const v1::LayoutPlan& plan);

}  // namespace tessera::planner
