// AttemptPolicy: what the coordinator decides when an attempt of a job fails, and how it reads to
// people. When one rank dies its peers fail too ("connection closed by peer"), so an attempt ends
// with several failures; the one to blame is the first that is not a consequence of another. A
// failure the job cannot outrun by restarting (a bad spec, unreadable data) ends the job at once.
// Also the straggler figures of a running job from its ranks' busy time per step.
//
// Pure functions over protos; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/daemon/failure_text.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"

namespace tessera::coordinator {

// A failure caused by another rank's (FAILURE_KIND_PEER_FAILED): recorded, never blamed while a
// cause is known.
bool IsConsequence(const v1::TrainerFailure& failure);

// Whether restarting from a checkpoint can get past a failure of `kind`: not for a spec the
// trainer cannot run or data it cannot read, which fail every attempt the same way.
bool IsRetryable(v1::FailureKind kind);

// Index into `failures` (non-empty) of the one to blame: the earliest (by time; unset times sort
// last, then by position) that is not a consequence, else the earliest.
size_t BlameIndex(const std::vector<v1::TrainerFailure>& failures);

// The loss-spike guard (JobSpec.guard): guard.max_rollbacks and guard.skip_batches with their
// defaults (0 means 3 and 1).
int GuardMaxRollbacks(const v1::GuardSpec& guard);
int64_t GuardSkipBatches(const v1::GuardSpec& guard);

// What the coordinator decides when an attempt of a guarded job ends with a blamed
// FAILURE_KIND_LOSS_SPIKE: a rollback (`rollback` set, to record and announce), or the job's
// failure (`rollback` unset). `reason` is the job's reason either way; a failure names the steps
// of every spike.
struct SpikeDecision {
  std::optional<v1::Rollback> rollback;
  std::string reason;
};
// `blamed` is the attempt's blamed failure, `spike` rank 0's report of it when it arrived (else
// the spike's step is the failure's step + 1: the trainer reports the last step it finished),
// `resume_step` the checkpoint step the next attempt would start from.
SpikeDecision DecideSpike(const v1::Job& job, int32_t attempt, const v1::TrainerFailure& blamed,
                          const std::optional<v1::LossSpike>& spike, int64_t resume_step);

// The spec a task of `job` runs: JobSpec.guard.skipped extended by the data every rollback so
// far skipped (Job.rollbacks), so that each later attempt skips the same batches.
void AddRollbackSkips(const v1::Job& job, v1::JobSpec* spec);

// Straggler figures from each rank's latest step time: the median busy seconds per step, the
// slowest rank and its skew (busy / median); `straggling` when skew > threshold and at least two
// ranks reported busy time. Ranks are returned sorted by rank.
v1::StragglerReport ComputeStraggler(std::vector<v1::RankStepTime> ranks, double threshold);

}  // namespace tessera::coordinator
