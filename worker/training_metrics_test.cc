#include "worker/training_metrics.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "common/clock.h"
#include "gtest/gtest.h"

namespace tessera::worker {
namespace {

v1::TrainerReport StepReport(const std::string& job_id, int64_t step, double loss) {
  v1::TrainerReport report;
  report.set_job_id(job_id);
  report.set_rank(0);
  v1::StepMetrics* m = report.mutable_metrics();
  m->set_step(step);
  m->set_loss(loss);
  m->set_grad_norm(0.5);
  m->set_learning_rate(1e-3);
  m->set_tokens_per_second(1000);
  m->set_epoch(0.25 * static_cast<double>(step));
  m->set_peak_memory_bytes(1 << 20);
  m->set_checkpoint_blocked_seconds(step == 2 ? 0.125 : 0.0);
  return report;
}

// name -> job_id -> value, from one Collect().
std::map<std::string, std::map<std::string, double>> Scrape(const TrainingMetrics& metrics) {
  std::map<std::string, std::map<std::string, double>> values;
  for (const auto& family : metrics.Collect()) {
    for (const auto& sample : family.metric) {
      EXPECT_EQ(sample.label.size(), 2u);
      if (sample.label.size() != 2) continue;
      EXPECT_EQ(sample.label[0].name, "job_id");
      EXPECT_EQ(sample.label[1].name, "rank");
      values[family.name][sample.label[0].value] = sample.gauge.value;
    }
  }
  return values;
}

TEST(TrainingMetricsTest, NewestStepAndEvaluationPerJobLabelledJobId) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 1, 5.0));
  metrics.Record(StepReport("job-1", 2, 4.0));
  v1::TrainerReport eval;
  eval.set_job_id("job-1");
  eval.mutable_eval()->set_loss(4.5);
  metrics.Record(eval);
  auto values = Scrape(metrics);
  EXPECT_EQ(values["tessera_train_loss"]["job-1"], 4.0);
  EXPECT_EQ(values["tessera_train_step"]["job-1"], 2);
  EXPECT_EQ(values["tessera_train_grad_norm"]["job-1"], 0.5);
  EXPECT_EQ(values["tessera_train_learning_rate"]["job-1"], 1e-3);
  EXPECT_EQ(values["tessera_eval_loss"]["job-1"], 4.5);
  EXPECT_EQ(values["tessera_train_epoch"]["job-1"], 0.5);
  EXPECT_EQ(values["tessera_train_peak_memory_bytes"]["job-1"], 1 << 20);
  EXPECT_EQ(values["tessera_train_checkpoint_blocked_seconds"]["job-1"], 0.125);
  // Every family is served, with its help, even the empty ones.
  EXPECT_EQ(metrics.Collect().size(), 11u);
}

TEST(TrainingMetricsTest, ADivergedStepReadsNaN) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 4, std::numeric_limits<double>::quiet_NaN()));
  EXPECT_TRUE(std::isnan(Scrape(metrics)["tessera_train_loss"]["job-1"]));
}

TEST(TrainingMetricsTest, AJobsSeriesExpireAfterItsLastReport) {
  SimulatedClock clock;
  TrainingMetrics metrics(absl::Minutes(10), &clock);
  metrics.Record(StepReport("old", 1, 3.0));
  clock.Advance(absl::Minutes(6));
  metrics.Record(StepReport("new", 1, 3.0));
  clock.Advance(absl::Minutes(5));  // "old" last reported 11 minutes ago, "new" 5
  auto values = Scrape(metrics);
  EXPECT_FALSE(values["tessera_train_loss"].contains("old"));
  EXPECT_TRUE(values["tessera_train_loss"].contains("new"));
}

}  // namespace
}  // namespace tessera::worker
