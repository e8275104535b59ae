#include "coordinator/service/job_series.h"

#include <algorithm>
#include <utility>

#include "common/daemon/metric_families.h"

namespace tessera::coordinator {
namespace {

prometheus::MetricFamily GaugeFamily(std::string name, std::string help) {
  return NewFamily(std::move(name), std::move(help), prometheus::MetricType::Gauge);
}

}  // namespace

void JobSeries::SetRunning(const std::string& job_id, std::optional<double> last_step_time,
                           std::optional<double> last_checkpoint_time) {
  absl::MutexLock lock(&mu_);
  Liveness& liveness = running_[job_id];
  if (last_step_time.has_value()) liveness.last_step_time = last_step_time;
  if (last_checkpoint_time.has_value()) liveness.last_checkpoint_time = last_checkpoint_time;
}

void JobSeries::DropRunning(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  running_.erase(job_id);
}

void JobSeries::SetStragglers(const std::map<std::string, v1::StragglerReport>& stragglers) {
  absl::MutexLock lock(&mu_);
  stragglers_ = stragglers;
}

std::vector<prometheus::MetricFamily> JobSeries::Collect() const {
  std::vector<std::pair<std::string, Liveness>> running;
  std::map<std::string, v1::StragglerReport> stragglers;
  {
    absl::MutexLock lock(&mu_);
    running.assign(running_.begin(), running_.end());
    stragglers = stragglers_;
  }
  std::sort(running.begin(), running.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  prometheus::MetricFamily ranks = GaugeFamily(
      "tessera_rank_step_seconds",
      "Seconds per optimizer step a running job's rank spends computing rather than waiting for "
      "its peers.");
  prometheus::MetricFamily skew = GaugeFamily(
      "tessera_job_straggler_skew",
      "A running job's slowest rank's busy seconds per step over the median rank's (1 = even).");
  for (const auto& [job_id, report] : stragglers) {
    std::vector<const v1::RankStepTime*> by_rank;
    for (const auto& rank : report.ranks()) by_rank.push_back(&rank);
    std::sort(by_rank.begin(), by_rank.end(),
              [](const auto* a, const auto* b) { return a->rank() < b->rank(); });
    for (const v1::RankStepTime* rank : by_rank) {
      AddSample(ranks, {{"job_id", job_id}, {"rank", std::to_string(rank->rank())}},
                rank->busy_seconds());
    }
    AddSample(skew, {{"job_id", job_id}}, report.skew());
  }
  prometheus::MetricFamily running_family = GaugeFamily(
      "tessera_job_running", "1 for each RUNNING job (no series for a job in another state).");
  prometheus::MetricFamily last_step = GaugeFamily(
      "tessera_job_last_step_timestamp_seconds",
      "Unix time of a RUNNING job's newest step metric point (kept while the job is stalled).");
  prometheus::MetricFamily last_checkpoint = GaugeFamily(
      "tessera_job_last_checkpoint_timestamp_seconds",
      "Unix time of a RUNNING job's newest committed checkpoint (no series before its first).");
  for (const auto& [job_id, liveness] : running) {
    AddSample(running_family, {{"job_id", job_id}}, 1);
    if (liveness.last_step_time.has_value()) {
      AddSample(last_step, {{"job_id", job_id}}, *liveness.last_step_time);
    }
    if (liveness.last_checkpoint_time.has_value()) {
      AddSample(last_checkpoint, {{"job_id", job_id}}, *liveness.last_checkpoint_time);
    }
  }
  std::vector<prometheus::MetricFamily> families;
  for (prometheus::MetricFamily* family :
       {&ranks, &skew, &running_family, &last_step, &last_checkpoint}) {
    if (!family->metric.empty()) families.push_back(std::move(*family));
  }
  return families;
}

}  // namespace tessera::coordinator
