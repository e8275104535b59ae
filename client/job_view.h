// The parts of `tessera get` and `tessera watch` that show where a job's step time goes and which
// GPUs it holds: rank 0's newest StepMetrics.breakdown as a block of phases and top collectives,
// every rank's heartbeat breakdown (StragglerReport) as a table, a one-line summary per step for
// `watch`, and each rank's GPU joined with its node's inventory, as a table or in the JSON. Each
// function returns what to print, or "" (the JSON unchanged) when the job has nothing of the
// kind (a trainer that sends no breakdown, a CPU job), so that the output of such jobs stays as
// it was.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessera/v1/job.pb.h"
#include "tessera/v1/metrics.pb.h"
#include "tessera/v1/node.pb.h"

namespace tessera::client {

// Collectives listed in the "where the time goes" block; the rest are counted in one line.
inline constexpr int kTopCollectives = 5;

// Whether `breakdown` holds any measured time (an older trainer leaves it unset, all zero).
bool HasBreakdown(const v1::StepTimeBreakdown& breakdown);

// "  Where the time goes (rank 0, step N, S s):" then one line per phase (seconds and % of the
// step) and the top collectives by kind/dim (seconds, % of the step, calls, bytes). Percentages are
// of step_time_seconds, or of the phases' sum when the step time is missing.
std::string TimeBreakdownBlock(const v1::StepMetrics& metrics);

// A mixture of experts' routing in `metrics` (StepMetrics.expert_load), "" for a dense model:
// "  experts (step N): imbalance (busiest expert / mean) 1.31 mean over 24 layers, 2.05 worst
// in layer 7" and, where the step's counts are there, that layer's busiest experts with their
// share of its slots.
std::string ExpertLoadBlock(const v1::StepMetrics& metrics);

// One line per rank of the straggler report: rank, node, step s, busy s, forward / backward /
// optimizer / data-wait % of the step, and its top collective. "" when no rank sent a breakdown.
std::string RankBreakdownTable(const v1::StragglerReport& straggler);

// `watch`'s compact summary of one step: "fwd 29% bwd 49% opt 7% data 2% other 13% | top
// all_reduce/dp 36%" (ckpt only when blocked). "" without a breakdown.
std::string BreakdownSummary(const v1::StepMetrics& metrics);

// `job` with each GPU rank's device named (RankPlacement.gpu_uuid, gpu_name) from its node's
// inventory in `nodes`, where the placement does not name it already (a job placed by a
// coordinator that did not record them). Ranks whose node or GPU is not listed stay unnamed.
v1::Job WithGpuIdentity(v1::Job job, const std::vector<v1::Node>& nodes);

// One line per GPU rank: rank, node, GPU index, and the UUID and product name its placement
// records ("?" for a UUID it does not know). "" for a job holding no GPU.
std::string GpuTable(const v1::Job& job);

// Whether any rank of `job` holds a GPU (`get` asks the coordinator for its nodes only then).
bool HoldsGpus(const v1::Job& job);

// One line of a loss-spike rollback (JobEvent.rollback, `watch`): "rollback after step 12 (loss
// 310.2, window median 2.41): resumes from step 10, skips 1 global batch(es) at step 12: <cause>".
std::string RollbackLine(const v1::Rollback& rollback);

// `get`'s block of a guarded job: "  rollbacks: N of M" and one RollbackLine per rollback; "" for a
// job without a guard.
std::string RollbackBlock(const v1::Job& job);

}  // namespace tessera::client
