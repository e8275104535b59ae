// Per-job training metrics on the worker's /metrics, from its trainers' reports, labelled job_id
// and rank (never `job`, which Prometheus reserves for the scrape job and would rename to
// exported_job). The names are the metrics contract (docs/observability.md):
// - gauges of rank 0's newest StepMetrics: tessera_train_loss, _tokens_per_second, _mfu_ratio,
//   _grad_norm, _learning_rate, _step, _epoch, _checkpoint_blocked_seconds, _max_steps, and
//   tessera_eval_loss (the newest evaluation); a diverged step's loss reads NaN;
// - counters of rank 0's StepMetrics: tessera_train_tokens_total, _samples_total, _steps_total
//   (the job's totals as the newest step states them, so a job resumed from a checkpoint goes on
//   from its count);
// - per rank, from every rank's RankStepMetrics: tessera_train_step_time_seconds and
//   _peak_memory_bytes (gauges; rank 0's StepMetrics where a rank sent none), and the counters
//   tessera_train_rank_steps_total, _phase_seconds_total{phase}, _collective_seconds_total and
//   _collective_bytes_total{kind,dim}, accumulated over the rank's reports;
// - tessera_train_last_report_timestamp_seconds: unix time the newest report of a rank arrived;
// - tessera_job_rollbacks_total: loss spikes rank 0 reported (TrainerReport.loss_spike), each of
//   which rolls the job back to its last checkpoint (or fails it past guard.max_rollbacks);
// - tessera_task_gpu_info{job_id,rank,node,gpu,UUID} 1 for each GPU a running rank holds;
// - a mixture of experts' routing in rank 0's newest step (StepMetrics.expert_load):
//   tessera_moe_expert_imbalance{layer} and tessera_moe_expert_tokens{expert} (summed over the
//   layers), so a job has layers + experts series, never layers x experts.
//
// A job's series stay while a rank of it runs on this worker, however long ago it last reported
// (a stalled job must stay on the dashboards), and disappear `retention` after both its last
// report and the last scrape that saw it running, so that job lists follow the jobs that run, not
// every job the node ever ran.
//
// Thread safety: Record, SetRunningRanks and Collect may be called from any thread; one
// absl::Mutex guards the series. Collect calls the running-ranks function outside that mutex.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::worker {

// How long a job's series stay after its last report, once no rank of it runs here.
inline constexpr absl::Duration kTrainingSeriesRetention = absl::Minutes(10);

// One rank of a task running on this worker.
struct RunningRank {
  std::string job_id;
  int rank = 0;
  // The node's GPU it holds (NVML index); -1 on the CPU.
  int gpu = -1;
  // That GPU's UUID, as the inventory reads it; empty when unknown.
  std::string gpu_uuid;
};

class TrainingMetrics final : public prometheus::Collectable {
 public:
  // `clock` (not owned) outlives the metrics.
  explicit TrainingMetrics(absl::Duration retention = kTrainingSeriesRetention,
                           Clock* clock = Clock::Real());

  // Where Collect learns which ranks run on node `node_id` now. `running` is called on every
  // Collect, without this object's lock held, and must be thread-safe; set before the first
  // Collect. Without it no job counts as running.
  void SetRunningRanks(std::string node_id, std::function<std::vector<RunningRank>()> running);

  // Takes StepMetrics, RankStepMetrics, EvalMetrics and LossSpike reports; ignores the others.
  void Record(const v1::TrainerReport& report);

  // The families above; drops expired jobs first.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  // Counters of a collective kind on a mesh dimension.
  struct CollectiveTotals {
    double seconds = 0;
    double bytes = 0;
  };
  struct Series {
    std::optional<v1::StepMetrics> step;
    std::optional<v1::RankStepMetrics> rank_step;
    std::optional<double> eval_loss;
    // Accumulated over the rank's RankStepMetrics.
    double rank_steps = 0;
    // LossSpike reports of the rank (rank 0 sends them).
    double loss_spikes = 0;
    std::map<std::string, double> phase_seconds;
    std::map<std::pair<std::string, std::string>, CollectiveTotals> collectives;
    // Arrival of the newest report.
    absl::Time updated;
  };
  using Key = std::pair<std::string, int>;

  const absl::Duration retention_;
  Clock* const clock_;
  std::string node_id_;
  std::function<std::vector<RunningRank>()> running_;
  mutable absl::Mutex mu_;
  // (job_id, rank) -> the newest values and the totals.
  mutable std::map<Key, Series> series_ ABSL_GUARDED_BY(mu_);
  // job_id -> when a Collect last saw a rank of it running here.
  mutable std::map<std::string, absl::Time> seen_running_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::worker
