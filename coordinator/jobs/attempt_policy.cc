#include "coordinator/jobs/attempt_policy.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/time_util.h"

namespace tessera::coordinator {
namespace {

int64_t TimeKey(const v1::TrainerFailure& failure) {
  if (!failure.has_time()) return std::numeric_limits<int64_t>::max();
  return google::protobuf::util::TimeUtil::TimestampToNanoseconds(failure.time());
}

}  // namespace

bool IsConsequence(const v1::TrainerFailure& failure) {
  return failure.kind() == v1::FAILURE_KIND_PEER_FAILED;
}

bool IsRetryable(v1::FailureKind kind) {
  return kind != v1::FAILURE_KIND_INVALID_SPEC && kind != v1::FAILURE_KIND_DATA_ERROR;
}

size_t BlameIndex(const std::vector<v1::TrainerFailure>& failures) {
  size_t best = 0;
  for (size_t i = 1; i < failures.size(); ++i) {
    const bool cause = !IsConsequence(failures[i]), best_cause = !IsConsequence(failures[best]);
    if (cause != best_cause) {
      if (cause) best = i;
      continue;
    }
    if (TimeKey(failures[i]) < TimeKey(failures[best])) best = i;
  }
  return best;
}

int GuardMaxRollbacks(const v1::GuardSpec& guard) {
  return guard.max_rollbacks() > 0 ? guard.max_rollbacks() : 3;
}

int64_t GuardSkipBatches(const v1::GuardSpec& guard) {
  return guard.skip_batches() > 0 ? guard.skip_batches() : 1;
}

SpikeDecision DecideSpike(const v1::Job& job, int32_t attempt, const v1::TrainerFailure& blamed,
                          const std::optional<v1::LossSpike>& spike, int64_t resume_step) {
  v1::LossSpike seen;
  if (spike.has_value()) {
    seen = *spike;
  } else {
    seen.set_step(blamed.step() + 1);
    seen.set_cause(blamed.message());
  }
  const v1::GuardSpec& guard = job.spec().guard();
  const int max_rollbacks = GuardMaxRollbacks(guard);
  SpikeDecision decision;
  if (job.rollbacks_size() >= max_rollbacks) {
    std::vector<int64_t> steps;
    for (const v1::Rollback& earlier : job.rollbacks()) steps.push_back(earlier.spike().step());
    steps.push_back(seen.step());
    decision.reason = absl::StrCat("loss spikes at steps ", absl::StrJoin(steps, ", "),
                                   ": no rollbacks left (guard.max_rollbacks ", max_rollbacks,
                                   "); the last: ", seen.cause());
    return decision;
  }
  v1::Rollback& rollback = decision.rollback.emplace();
  *rollback.mutable_spike() = seen;
  rollback.set_attempt(attempt);
  rollback.set_resume_step(resume_step);
  rollback.mutable_skipped()->set_step(seen.step());
  rollback.mutable_skipped()->set_batches(GuardSkipBatches(guard));
  decision.reason = absl::StrCat(
      "loss spike: ", seen.cause(), "; rolling back to ",
      resume_step > 0 ? absl::StrCat("the checkpoint of step ", resume_step)
                      : std::string("the start"),
      " and skipping ", rollback.skipped().batches(), " global batch(es) at step ", seen.step(),
      " (rollback ", job.rollbacks_size() + 1, " of ", max_rollbacks, ")");
  return decision;
}

void AddRollbackSkips(const v1::Job& job, v1::JobSpec* spec) {
  for (const v1::Rollback& rollback : job.rollbacks()) {
    *spec->mutable_guard()->add_skipped() = rollback.skipped();
  }
}

v1::StragglerReport ComputeStraggler(std::vector<v1::RankStepTime> ranks, double threshold) {
  std::sort(ranks.begin(), ranks.end(),
            [](const auto& a, const auto& b) { return a.rank() < b.rank(); });
  v1::StragglerReport report;
  std::vector<double> busy;
  const v1::RankStepTime* slowest = nullptr;
  for (const auto& rank : ranks) {
    *report.add_ranks() = rank;
    if (rank.busy_seconds() <= 0) continue;
    busy.push_back(rank.busy_seconds());
    if (slowest == nullptr || rank.busy_seconds() > slowest->busy_seconds()) slowest = &rank;
  }
  if (busy.empty()) return report;
  std::sort(busy.begin(), busy.end());
  const size_t n = busy.size();
  const double median = n % 2 == 1 ? busy[n / 2] : (busy[n / 2 - 1] + busy[n / 2]) / 2;
  report.set_median_busy_seconds(median);
  report.set_slowest_rank(slowest->rank());
  report.set_slowest_node_id(slowest->node_id());
  report.set_skew(median > 0 ? slowest->busy_seconds() / median : 1.0);
  report.set_straggling(n >= 2 && report.skew() > threshold);
  return report;
}

}  // namespace tessera::coordinator
