#include "worker/training_metrics.h"

#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace tessera::worker {
namespace {

struct GaugeSpec {
  const char* name;
  const char* help;
  // The value from a job's step metrics; the eval family reads eval_loss instead.
  double (*value)(const v1::StepMetrics&);
};

constexpr GaugeSpec kStepGauges[] = {
    {"tessera_train_loss",
     "Training loss (nats per token) of the newest step reported by a trainer; NaN when the "
     "step's loss was not finite",
     [](const v1::StepMetrics& m) { return m.loss(); }},
    {"tessera_train_tokens_per_second", "Training tokens per second of the whole job, newest step",
     [](const v1::StepMetrics& m) { return m.tokens_per_second(); }},
    {"tessera_train_mfu_ratio", "Model FLOPs utilisation of the newest step, in [0, 1]",
     [](const v1::StepMetrics& m) { return m.mfu(); }},
    {"tessera_train_step_time_seconds", "Wall time of the newest optimizer step",
     [](const v1::StepMetrics& m) { return m.step_time_seconds(); }},
    {"tessera_train_grad_norm", "Global gradient norm of the newest step, before clipping",
     [](const v1::StepMetrics& m) { return m.grad_norm(); }},
    {"tessera_train_learning_rate", "Learning rate of the newest step",
     [](const v1::StepMetrics& m) { return m.learning_rate(); }},
    {"tessera_train_step", "Newest optimizer step reported",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.step()); }},
    {"tessera_train_epoch", "Epochs of the training data seen by the newest step (fractional)",
     [](const v1::StepMetrics& m) { return m.epoch(); }},
    {"tessera_train_peak_memory_bytes",
     "Peak memory of the newest step on this rank: GPU memory allocated, or the process's peak "
     "RSS on CPU",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.peak_memory_bytes()); }},
    {"tessera_train_checkpoint_blocked_seconds",
     "Time the newest step waited for a checkpoint save (its barrier, the copy of the state to "
     "host memory if unfinished at the optimizer step, or the previous asynchronous save still "
     "writing); 0 for a step without one",
     [](const v1::StepMetrics& m) { return m.checkpoint_blocked_seconds(); }},
};

prometheus::ClientMetric Sample(const std::pair<std::string, int>& key, double value) {
  prometheus::ClientMetric metric;
  metric.label = {{"job_id", key.first}, {"rank", std::to_string(key.second)}};
  metric.gauge.value = value;
  return metric;
}

}  // namespace

TrainingMetrics::TrainingMetrics(absl::Duration retention, Clock* clock)
    : retention_(retention), clock_(clock) {}

void TrainingMetrics::Record(const v1::TrainerReport& report) {
  if (!report.has_metrics() && !report.has_eval()) return;
  absl::MutexLock lock(&mu_);
  Series& series = series_[{report.job_id(), report.rank()}];
  if (report.has_metrics()) series.step = report.metrics();
  if (report.has_eval()) series.eval_loss = report.eval().loss();
  series.updated = clock_->Now();
}

std::vector<prometheus::MetricFamily> TrainingMetrics::Collect() const {
  absl::MutexLock lock(&mu_);
  const absl::Time cutoff = clock_->Now() - retention_;
  std::erase_if(series_, [cutoff](const auto& entry) { return entry.second.updated < cutoff; });
  std::vector<prometheus::MetricFamily> families;
  for (const GaugeSpec& spec : kStepGauges) {
    prometheus::MetricFamily& family = families.emplace_back();
    family.name = spec.name;
    family.help = spec.help;
    family.type = prometheus::MetricType::Gauge;
    for (const auto& [key, series] : series_) {
      if (series.step) family.metric.push_back(Sample(key, spec.value(*series.step)));
    }
  }
  prometheus::MetricFamily& eval = families.emplace_back();
  eval.name = "tessera_eval_loss";
  eval.help = "Validation loss (nats per token) of the newest evaluation";
  eval.type = prometheus::MetricType::Gauge;
  for (const auto& [key, series] : series_) {
    if (series.eval_loss) eval.metric.push_back(Sample(key, *series.eval_loss));
  }
  return families;
}

}  // namespace tessera::worker
