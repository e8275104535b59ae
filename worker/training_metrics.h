// Per-job training metrics on the worker's /metrics, from its trainers' reports, labelled job_id
// and rank (never `job`, which Prometheus reserves for the scrape job and would rename to
// exported_job): tessera_train_loss, tessera_train_tokens_per_second, tessera_train_mfu_ratio,
// tessera_train_step_time_seconds, tessera_train_grad_norm, tessera_train_learning_rate,
// tessera_train_step (the newest step's values; a diverged step's loss reads NaN) and
// tessera_eval_loss (the newest evaluation). Gauges hold the newest values, so a scrape never
// double counts.
//
// A job's series disappear `retention` after its last report, so that dashboards' job lists and
// alerts (a NaN loss) follow the jobs that run, not every job the node ever ran.
//
// Thread safety: Record and Collect may be called from any thread; one absl::Mutex guards the
// series.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "tessera/v1/trainer.pb.h"

namespace tessera::worker {

// How long a job's series stay after its last report.
inline constexpr absl::Duration kTrainingSeriesRetention = absl::Minutes(10);

class TrainingMetrics final : public prometheus::Collectable {
 public:
  // `clock` (not owned) outlives the metrics.
  explicit TrainingMetrics(absl::Duration retention = kTrainingSeriesRetention,
                           Clock* clock = Clock::Real());

  // Takes a StepMetrics or EvalMetrics report; ignores other reports.
  void Record(const v1::TrainerReport& report);

  // The families above, each sample labelled job_id and rank; drops expired jobs first.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  struct Series {
    std::optional<v1::StepMetrics> step;
    std::optional<double> eval_loss;
    absl::Time updated;
  };
  const absl::Duration retention_;
  Clock* const clock_;
  mutable absl::Mutex mu_;
  // (job_id, rank) -> the newest values.
  mutable std::map<std::pair<std::string, int>, Series> series_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::worker
