#include "worker/training_metrics.h"

#include <cmath>
#include <deque>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace tessera::worker {
namespace {

struct GaugeSpec {
  const char* name;
  const char* help;
  double (*value)(const v1::StepMetrics&);
};

// Gauges of rank 0's newest StepMetrics.
constexpr GaugeSpec kStepGauges[] = {
    {"tessera_train_loss",
     "Training loss (nats per token) of the newest step reported by a trainer; NaN when the "
     "step's loss was not finite",
     [](const v1::StepMetrics& m) { return m.loss(); }},
    {"tessera_train_tokens_per_second", "Training tokens per second of the whole job, newest step",
     [](const v1::StepMetrics& m) { return m.tokens_per_second(); }},
    {"tessera_train_mfu_ratio", "Model FLOPs utilisation of the newest step, in [0, 1]",
     [](const v1::StepMetrics& m) { return m.mfu(); }},
    {"tessera_train_grad_norm", "Global gradient norm of the newest step, before clipping",
     [](const v1::StepMetrics& m) { return m.grad_norm(); }},
    {"tessera_train_learning_rate", "Learning rate of the newest step",
     [](const v1::StepMetrics& m) { return m.learning_rate(); }},
    {"tessera_train_step", "Newest optimizer step reported",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.step()); }},
    {"tessera_train_epoch", "Epochs of the training data seen by the newest step (fractional)",
     [](const v1::StepMetrics& m) { return m.epoch(); }},
    {"tessera_train_checkpoint_blocked_seconds",
     "Time the newest step waited for a checkpoint save (its barrier, the copy of the state to "
     "host memory if unfinished at the optimizer step, or the previous asynchronous save still "
     "writing); 0 for a step without one",
     [](const v1::StepMetrics& m) { return m.checkpoint_blocked_seconds(); }},
    {"tessera_train_max_steps",
     "The run's last optimizer step (max_steps, or what its epochs "
     "come to)",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.max_steps()); }},
};

// Samples per optimizer step: the trainer reports samples_per_second as the global batch over the
// step's wall time, so their product is the global batch (rounded off its floating-point error).
double SamplesPerStep(const v1::StepMetrics& m) {
  return std::round(m.samples_per_second() * m.step_time_seconds());
}

// Counters of rank 0's newest StepMetrics: the job's running totals.
constexpr GaugeSpec kStepCounters[] = {
    {"tessera_train_tokens_total", "Training tokens processed by the job, as of its newest step",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.tokens_seen()); }},
    {"tessera_train_samples_total",
     "Training sequences processed by the job (newest step x global batch)",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.step()) * SamplesPerStep(m); }},
    {"tessera_train_steps_total", "Optimizer steps completed by the job (its newest step)",
     [](const v1::StepMetrics& m) { return static_cast<double>(m.step()); }},
};

// The phases of StepTimeBreakdown, by their label value.
struct Phase {
  const char* label;
  double (*seconds)(const v1::StepTimeBreakdown&);
};
constexpr Phase kPhases[] = {
    {"forward", [](const v1::StepTimeBreakdown& b) { return b.forward_seconds(); }},
    {"backward", [](const v1::StepTimeBreakdown& b) { return b.backward_seconds(); }},
    {"optimizer", [](const v1::StepTimeBreakdown& b) { return b.optimizer_seconds(); }},
    {"data_wait", [](const v1::StepTimeBreakdown& b) { return b.data_wait_seconds(); }},
    {"checkpoint_blocked",
     [](const v1::StepTimeBreakdown& b) { return b.checkpoint_blocked_seconds(); }},
    {"other", [](const v1::StepTimeBreakdown& b) { return b.other_seconds(); }},
};

// A deque, so that the references AddFamily returns stay valid while more families are added.
using Families = std::deque<prometheus::MetricFamily>;

prometheus::MetricFamily& AddFamily(Families& families, const char* name, const char* help,
                                    prometheus::MetricType type) {
  prometheus::MetricFamily& family = families.emplace_back();
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

// A sample labelled job_id and rank, then `extra`, holding `value` as the family's type wants.
void AddSample(prometheus::MetricFamily& family, const std::pair<std::string, int>& key,
               double value, std::vector<prometheus::ClientMetric::Label> extra = {}) {
  prometheus::ClientMetric& metric = family.metric.emplace_back();
  metric.label = {{"job_id", key.first}, {"rank", std::to_string(key.second)}};
  for (auto& label : extra) metric.label.push_back(std::move(label));
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
}

}  // namespace

TrainingMetrics::TrainingMetrics(absl::Duration retention, Clock* clock)
    : retention_(retention), clock_(clock) {}

void TrainingMetrics::SetRunningRanks(std::string node_id,
                                      std::function<std::vector<RunningRank>()> running) {
  node_id_ = std::move(node_id);
  running_ = std::move(running);
}

void TrainingMetrics::Record(const v1::TrainerReport& report) {
  if (!report.has_metrics() && !report.has_eval() && !report.has_rank_step() &&
      !report.has_loss_spike()) {
    return;
  }
  absl::MutexLock lock(&mu_);
  Series& series = series_[{report.job_id(), report.rank()}];
  if (report.has_metrics()) series.step = report.metrics();
  if (report.has_eval()) series.eval_loss = report.eval().loss();
  if (report.has_loss_spike()) series.loss_spikes += 1;
  if (report.has_rank_step()) {
    const v1::RankStepMetrics& rank_step = report.rank_step();
    series.rank_step = rank_step;
    series.rank_steps += 1;
    for (const Phase& phase : kPhases) {
      series.phase_seconds[phase.label] += phase.seconds(rank_step.breakdown());
    }
    for (const v1::CollectiveTime& collective : rank_step.breakdown().collectives()) {
      CollectiveTotals& totals = series.collectives[{collective.kind(), collective.dim()}];
      totals.seconds += collective.seconds();
      totals.bytes += static_cast<double>(collective.bytes());
    }
  }
  series.updated = clock_->Now();
}

std::vector<prometheus::MetricFamily> TrainingMetrics::Collect() const {
  using prometheus::MetricType;
  // Outside mu_: the agent takes its own lock to list its ranks.
  const std::vector<RunningRank> running = running_ ? running_() : std::vector<RunningRank>();
  absl::MutexLock lock(&mu_);
  const absl::Time now = clock_->Now();
  for (const RunningRank& rank : running) seen_running_[rank.job_id] = now;
  const absl::Time cutoff = now - retention_;
  std::erase_if(seen_running_, [cutoff](const auto& entry) { return entry.second < cutoff; });
  // A loop rather than erase_if: the thread-safety analysis does not see a lambda hold mu_.
  for (auto it = series_.begin(); it != series_.end();) {
    const bool stale = it->second.updated < cutoff && !seen_running_.contains(it->first.first);
    it = stale ? series_.erase(it) : std::next(it);
  }

  Families families;
  for (const GaugeSpec& spec : kStepGauges) {
    auto& family = AddFamily(families, spec.name, spec.help, MetricType::Gauge);
    for (const auto& [key, series] : series_) {
      if (series.step) AddSample(family, key, spec.value(*series.step));
    }
  }
  for (const GaugeSpec& spec : kStepCounters) {
    auto& family = AddFamily(families, spec.name, spec.help, MetricType::Counter);
    for (const auto& [key, series] : series_) {
      if (series.step) AddSample(family, key, spec.value(*series.step));
    }
  }
  auto& eval =
      AddFamily(families, "tessera_eval_loss",
                "Validation loss (nats per token) of the newest evaluation", MetricType::Gauge);
  for (const auto& [key, series] : series_) {
    if (series.eval_loss) AddSample(eval, key, *series.eval_loss);
  }

  // A mixture of experts' routing in the newest step: per layer (bounded by the model's layers)
  // and per expert summed over the layers (bounded by its experts), never layer x expert.
  auto& imbalance = AddFamily(
      families, "tessera_moe_expert_imbalance",
      "Mixture of experts: the busiest expert's token slots over the mean per expert in each "
      "layer, newest step (1 = balanced)",
      MetricType::Gauge);
  auto& expert_tokens = AddFamily(
      families, "tessera_moe_expert_tokens",
      "Mixture of experts: token slots routed to each expert in the newest step, summed over the "
      "layers",
      MetricType::Gauge);
  for (const auto& [key, series] : series_) {
    if (!series.step) continue;
    std::vector<double> per_expert;
    for (const v1::ExpertLoad& load : series.step->expert_load()) {
      AddSample(imbalance, key, load.imbalance(), {{"layer", absl::StrCat(load.layer())}});
      if (per_expert.size() < static_cast<size_t>(load.tokens_size())) {
        per_expert.resize(load.tokens_size());
      }
      for (int e = 0; e < load.tokens_size(); ++e) {
        per_expert[e] += static_cast<double>(load.tokens(e));
      }
    }
    for (size_t e = 0; e < per_expert.size(); ++e) {
      AddSample(expert_tokens, key, per_expert[e], {{"expert", absl::StrCat(e)}});
    }
  }

  // Per rank: its own RankStepMetrics, else (a trainer that sends none) rank 0's StepMetrics.
  auto& step_time =
      AddFamily(families, "tessera_train_step_time_seconds",
                "Wall time of the newest optimizer step on this rank", MetricType::Gauge);
  auto& peak_memory = AddFamily(
      families, "tessera_train_peak_memory_bytes",
      "Peak memory of the newest step on this rank: GPU memory allocated, or the process's peak "
      "RSS on CPU",
      MetricType::Gauge);
  for (const auto& [key, series] : series_) {
    if (series.rank_step) {
      AddSample(step_time, key, series.rank_step->step_time_seconds());
      AddSample(peak_memory, key, static_cast<double>(series.rank_step->peak_memory_bytes()));
    } else if (series.step) {
      AddSample(step_time, key, series.step->step_time_seconds());
      AddSample(peak_memory, key, static_cast<double>(series.step->peak_memory_bytes()));
    }
  }
  auto& rank_steps = AddFamily(families, "tessera_train_rank_steps_total",
                               "Optimizer steps this rank reported", MetricType::Counter);
  auto& phases = AddFamily(
      families, "tessera_train_phase_seconds_total",
      "Seconds of this rank's steps spent in each phase (forward, backward, optimizer, "
      "data_wait, checkpoint_blocked, other); over tessera_train_rank_steps_total: seconds per "
      "step",
      MetricType::Counter);
  auto& collective_seconds = AddFamily(
      families, "tessera_train_collective_seconds_total",
      "Seconds this rank spent in collectives, by kind and process-group dimension (overlaps "
      "the phase that issues them)",
      MetricType::Counter);
  auto& collective_bytes =
      AddFamily(families, "tessera_train_collective_bytes_total",
                "Bytes of this rank's input to collectives, by kind and process-group dimension",
                MetricType::Counter);
  for (const auto& [key, series] : series_) {
    if (!series.rank_step) continue;
    AddSample(rank_steps, key, series.rank_steps);
    for (const auto& [phase, seconds] : series.phase_seconds) {
      AddSample(phases, key, seconds, {{"phase", phase}});
    }
    for (const auto& [kind_dim, totals] : series.collectives) {
      AddSample(collective_seconds, key, totals.seconds,
                {{"kind", kind_dim.first}, {"dim", kind_dim.second}});
      AddSample(collective_bytes, key, totals.bytes,
                {{"kind", kind_dim.first}, {"dim", kind_dim.second}});
    }
  }
  auto& last_report = AddFamily(families, "tessera_train_last_report_timestamp_seconds",
                                "Unix time the newest report of this rank arrived at the worker",
                                MetricType::Gauge);
  for (const auto& [key, series] : series_) {
    AddSample(last_report, key, absl::ToDoubleSeconds(series.updated - absl::UnixEpoch()));
  }

  auto& rollbacks = AddFamily(
      families, "tessera_job_rollbacks_total",
      "Loss spikes the job's guard caught (each rolls the job back to its last checkpoint)",
      MetricType::Counter);
  for (const auto& [key, series] : series_) {
    if (series.loss_spikes > 0) AddSample(rollbacks, key, series.loss_spikes);
  }

  auto& gpu_info =
      AddFamily(families, "tessera_task_gpu_info",
                "1 for each GPU a running rank of a job holds on this node", MetricType::Gauge);
  for (const RunningRank& rank : running) {
    if (rank.gpu < 0) continue;
    AddSample(gpu_info, {rank.job_id, rank.rank}, 1.0,
              {{"node", node_id_}, {"gpu", absl::StrCat(rank.gpu)}, {"UUID", rank.gpu_uuid}});
  }
  return {std::make_move_iterator(families.begin()), std::make_move_iterator(families.end())};
}

}  // namespace tessera::worker
