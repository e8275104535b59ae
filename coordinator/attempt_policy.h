// AttemptPolicy: what the coordinator decides when an attempt of a job fails, and how it reads to
// people. When one rank dies its peers fail too ("connection closed by peer"), so an attempt ends
// with several failures; the one to blame is the first that is not a consequence of another. A
// failure the job cannot outrun by restarting (a bad spec, unreadable data) ends the job at once.
// Also the straggler figures of a running job from its ranks' busy time per step.
//
// Pure functions over protos; thread-safe.
#pragma once

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

// Straggler figures from each rank's latest step time: the median busy seconds per step, the
// slowest rank and its skew (busy / median); `straggling` when skew > threshold and at least two
// ranks reported busy time. Ranks are returned sorted by rank.
v1::StragglerReport ComputeStraggler(std::vector<v1::RankStepTime> ranks, double threshold);

}  // namespace tessera::coordinator
