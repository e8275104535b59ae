#include "worker/training_metrics.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace tessera::worker {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

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
  // A global batch of 8 sequences of 16 tokens in 0.3 s: 8 / 0.3 is not exact in binary.
  m->set_step_time_seconds(0.3);
  m->set_samples_per_second(8 / 0.3);
  m->set_tokens_seen(step * 8 * 16);
  m->set_max_steps(100);
  m->set_epoch(0.25 * static_cast<double>(step));
  m->set_peak_memory_bytes(1 << 20);
  m->set_checkpoint_blocked_seconds(step == 2 ? 0.125 : 0.0);
  return report;
}

v1::TrainerReport RankStepReport(const std::string& job_id, int rank, int64_t step, double forward,
                                 int64_t peak_memory) {
  v1::TrainerReport report;
  report.set_job_id(job_id);
  report.set_rank(rank);
  v1::RankStepMetrics* m = report.mutable_rank_step();
  m->set_step(step);
  m->set_step_time_seconds(forward + 1.5);
  m->set_peak_memory_bytes(peak_memory);
  v1::StepTimeBreakdown* b = m->mutable_breakdown();
  b->set_forward_seconds(forward);
  b->set_backward_seconds(1);
  b->set_optimizer_seconds(0.25);
  b->set_data_wait_seconds(0.125);
  b->set_other_seconds(0.125);
  v1::CollectiveTime* all_reduce = b->add_collectives();
  all_reduce->set_kind("all_reduce");
  all_reduce->set_dim("dp");
  all_reduce->set_seconds(0.5);
  all_reduce->set_calls(2);
  all_reduce->set_bytes(4096);
  v1::CollectiveTime* send_recv = b->add_collectives();
  send_recv->set_kind("send_recv");
  send_recv->set_dim("pp");
  send_recv->set_seconds(0.25);
  send_recv->set_calls(4);
  send_recv->set_bytes(1000);
  return report;
}

// Every line of the exposition, so that a test matches whole lines: a substring match would take
// `x{...} 10` for `x{...} 1`.
std::vector<std::string> Lines(const TrainingMetrics& metrics) {
  return absl::StrSplit(prometheus::TextSerializer().Serialize(metrics.Collect()), '\n',
                        absl::SkipEmpty());
}

std::string Rank(const std::string& job_id, int rank) {
  return "{job_id=\"" + job_id + "\",rank=\"" + std::to_string(rank) + "\"}";
}

TEST(TrainingMetricsTest, NewestStepAndEvaluationPerJobLabelledJobId) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 1, 5.0));
  metrics.Record(StepReport("job-1", 2, 4.0));
  v1::TrainerReport eval;
  eval.set_job_id("job-1");
  eval.mutable_eval()->set_loss(4.5);
  metrics.Record(eval);
  const std::string r0 = Rank("job-1", 0);
  const auto lines = Lines(metrics);
  EXPECT_THAT(lines, Contains("tessera_train_loss" + r0 + " 4"));
  EXPECT_THAT(lines, Contains("tessera_train_step" + r0 + " 2"));
  EXPECT_THAT(lines, Contains("tessera_train_grad_norm" + r0 + " 0.5"));
  EXPECT_THAT(lines, Contains("tessera_train_learning_rate" + r0 + " 0.001"));
  EXPECT_THAT(lines, Contains("tessera_eval_loss" + r0 + " 4.5"));
  EXPECT_THAT(lines, Contains("tessera_train_epoch" + r0 + " 0.5"));
  EXPECT_THAT(lines, Contains("tessera_train_checkpoint_blocked_seconds" + r0 + " 0.125"));
  // Without rank step reports, rank 0's step time and memory come from its StepMetrics.
  EXPECT_THAT(lines, Contains("tessera_train_peak_memory_bytes" + r0 + " 1048576"));
  EXPECT_THAT(lines, Contains("tessera_train_step_time_seconds" + r0 + " 0.3"));
  // Every family is served, with its help, even the empty ones.
  EXPECT_EQ(metrics.Collect().size(), 24u);
}

// A mixture of experts' routing: each layer's imbalance, and each expert's slots summed over the
// layers; a dense job has neither.
TEST(TrainingMetricsTest, ExpertLoadPerLayerAndPerExpert) {
  TrainingMetrics metrics;
  v1::TrainerReport report = StepReport("job-1", 3, 4.0);
  const int64_t tokens[2][4] = {{6, 1, 1, 0}, {2, 2, 2, 2}};
  for (int layer = 0; layer < 2; ++layer) {
    v1::ExpertLoad* load = report.mutable_metrics()->add_expert_load();
    load->set_layer(layer);
    for (int64_t t : tokens[layer]) load->add_tokens(t);
    load->set_imbalance(layer == 0 ? 3.0 : 1.0);
  }
  metrics.Record(report);
  metrics.Record(StepReport("dense", 3, 4.0));
  const auto lines = Lines(metrics);
  const std::string prefix = "{job_id=\"job-1\",rank=\"0\",";
  EXPECT_THAT(lines, Contains("tessera_moe_expert_imbalance" + prefix + "layer=\"0\"} 3"));
  EXPECT_THAT(lines, Contains("tessera_moe_expert_imbalance" + prefix + "layer=\"1\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_moe_expert_tokens" + prefix + "expert=\"0\"} 8"));
  EXPECT_THAT(lines, Contains("tessera_moe_expert_tokens" + prefix + "expert=\"3\"} 2"));
  EXPECT_THAT(lines, Not(Contains(HasSubstr("tessera_moe_expert_tokens{job_id=\"dense\""))));
  int series = 0;
  for (const std::string& line : lines) series += line.rfind("tessera_moe_", 0) == 0;
  EXPECT_EQ(series, 2 + 4) << "layers + experts, not layers x experts";
}

TEST(TrainingMetricsTest, JobTotalsAreCountersOfTheNewestStep) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 1, 5.0));
  metrics.Record(StepReport("job-1", 7, 4.0));
  const std::string r0 = Rank("job-1", 0);
  const auto lines = Lines(metrics);
  for (const char* name :
       {"tessera_train_tokens_total", "tessera_train_samples_total", "tessera_train_steps_total"}) {
    EXPECT_THAT(lines, Contains(std::string("# TYPE ") + name + " counter"));
  }
  EXPECT_THAT(lines, Contains("tessera_train_tokens_total" + r0 + " 896"));
  EXPECT_THAT(lines, Contains("tessera_train_samples_total" + r0 + " 56"));
  EXPECT_THAT(lines, Contains("tessera_train_steps_total" + r0 + " 7"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_train_max_steps gauge"));
  EXPECT_THAT(lines, Contains("tessera_train_max_steps" + r0 + " 100"));
}

TEST(TrainingMetricsTest, EachLossSpikeCountsARollback) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 3, 4.0));
  EXPECT_THAT(Lines(metrics), Not(Contains(::testing::StartsWith("tessera_job_rollbacks_total{"))));
  v1::TrainerReport spike;
  spike.set_job_id("job-1");
  spike.set_rank(0);
  spike.mutable_loss_spike()->set_step(4);
  metrics.Record(spike);
  metrics.Record(spike);
  const auto lines = Lines(metrics);
  EXPECT_THAT(lines, Contains("# TYPE tessera_job_rollbacks_total counter"));
  EXPECT_THAT(lines, Contains("tessera_job_rollbacks_total" + Rank("job-1", 0) + " 2"));
}

TEST(TrainingMetricsTest, RankStepsAccumulatePerRankPhaseAndCollective) {
  TrainingMetrics metrics;
  metrics.Record(RankStepReport("job-1", 0, 1, 2.0, 100));
  metrics.Record(RankStepReport("job-1", 1, 1, 3.0, 200));
  metrics.Record(RankStepReport("job-1", 1, 2, 0.5, 300));
  const std::string r0 = Rank("job-1", 0);
  const std::string r1 = Rank("job-1", 1);
  auto labelled = [](const std::string& job_id, int rank, const std::string& extra) {
    return "{job_id=\"" + job_id + "\",rank=\"" + std::to_string(rank) + "\"," + extra + "}";
  };
  const auto lines = Lines(metrics);
  EXPECT_THAT(lines, Contains("# TYPE tessera_train_phase_seconds_total counter"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_train_collective_seconds_total counter"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_train_collective_bytes_total counter"));
  EXPECT_THAT(lines, Contains("# TYPE tessera_train_rank_steps_total counter"));
  EXPECT_THAT(lines, Contains("tessera_train_rank_steps_total" + r0 + " 1"));
  EXPECT_THAT(lines, Contains("tessera_train_rank_steps_total" + r1 + " 2"));
  // The newest step's gauges, each rank its own.
  EXPECT_THAT(lines, Contains("tessera_train_step_time_seconds" + r0 + " 3.5"));
  EXPECT_THAT(lines, Contains("tessera_train_step_time_seconds" + r1 + " 2"));
  EXPECT_THAT(lines, Contains("tessera_train_peak_memory_bytes" + r0 + " 100"));
  EXPECT_THAT(lines, Contains("tessera_train_peak_memory_bytes" + r1 + " 300"));
  // Sums over the rank's reports.
  const std::string phase = "tessera_train_phase_seconds_total";
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"forward\"") + " 3.5"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"backward\"") + " 2"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"optimizer\"") + " 0.5"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"data_wait\"") + " 0.25"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"checkpoint_blocked\"") + " 0"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 1, "phase=\"other\"") + " 0.25"));
  EXPECT_THAT(lines, Contains(phase + labelled("job-1", 0, "phase=\"forward\"") + " 2"));
  EXPECT_THAT(lines, Contains("tessera_train_collective_seconds_total" +
                              labelled("job-1", 1, "kind=\"all_reduce\",dim=\"dp\"") + " 1"));
  EXPECT_THAT(lines, Contains("tessera_train_collective_bytes_total" +
                              labelled("job-1", 1, "kind=\"all_reduce\",dim=\"dp\"") + " 8192"));
  EXPECT_THAT(lines, Contains("tessera_train_collective_seconds_total" +
                              labelled("job-1", 1, "kind=\"send_recv\",dim=\"pp\"") + " 0.5"));
  EXPECT_THAT(lines, Contains("tessera_train_collective_bytes_total" +
                              labelled("job-1", 0, "kind=\"send_recv\",dim=\"pp\"") + " 1000"));
  // A rank step carries no loss: no job-level series for rank 1.
  for (const std::string& line : lines) {
    if (line.starts_with("tessera_train_loss")) {
      EXPECT_THAT(line, Not(HasSubstr(r1)));
    }
  }
}

TEST(TrainingMetricsTest, ADivergedStepReadsNaN) {
  TrainingMetrics metrics;
  metrics.Record(StepReport("job-1", 4, std::numeric_limits<double>::quiet_NaN()));
  EXPECT_THAT(Lines(metrics), Contains("tessera_train_loss" + Rank("job-1", 0) + " Nan"));
}

TEST(TrainingMetricsTest, AJobsSeriesExpireAfterItsLastReport) {
  SimulatedClock clock;
  TrainingMetrics metrics(absl::Minutes(10), &clock);
  metrics.Record(StepReport("old", 1, 3.0));
  clock.Advance(absl::Minutes(6));
  metrics.Record(StepReport("new", 1, 3.0));
  clock.Advance(absl::Minutes(5));  // "old" last reported 11 minutes ago, "new" 5
  const auto lines = Lines(metrics);
  EXPECT_THAT(lines, Not(Contains("tessera_train_loss" + Rank("old", 0) + " 3")));
  EXPECT_THAT(lines, Contains("tessera_train_loss" + Rank("new", 0) + " 3"));
}

TEST(TrainingMetricsTest, AStalledJobStaysWhileItRunsAndGoesRetentionAfterItEnds) {
  SimulatedClock clock;
  const absl::Time start = clock.Now();
  TrainingMetrics metrics(absl::Minutes(10), &clock);
  std::vector<RunningRank> running = {{.job_id = "stalled", .rank = 0, .gpu = -1, .gpu_uuid = ""},
                                      {.job_id = "stalled", .rank = 1, .gpu = -1, .gpu_uuid = ""}};
  metrics.SetRunningRanks("node-1", [&running] { return running; });
  metrics.Record(StepReport("stalled", 3, 2.5));
  metrics.Record(RankStepReport("stalled", 1, 3, 1.0, 100));
  const std::string last_report = "tessera_train_last_report_timestamp_seconds";
  const std::string report_time = " " + std::to_string(absl::ToUnixSeconds(start));
  EXPECT_THAT(Lines(metrics), Contains(last_report + Rank("stalled", 1) + report_time));

  // No report for an hour, scraped every minute, but its ranks still run: all stays.
  for (int minute = 0; minute < 60; ++minute) {
    clock.Advance(absl::Minutes(1));
    ASSERT_THAT(Lines(metrics), Contains("tessera_train_loss" + Rank("stalled", 0) + " 2.5"))
        << "minute " << minute;
  }
  auto lines = Lines(metrics);
  EXPECT_THAT(lines, Contains("tessera_train_rank_steps_total" + Rank("stalled", 1) + " 1"));
  // The timestamp still says when it last reported, so "stalled" can be told.
  EXPECT_THAT(lines, Contains(last_report + Rank("stalled", 0) + report_time));

  // The task ends: retention after the last scrape that saw it running, the series go.
  running.clear();
  clock.Advance(absl::Minutes(9));
  EXPECT_THAT(Lines(metrics), Contains("tessera_train_loss" + Rank("stalled", 0) + " 2.5"));
  clock.Advance(absl::Minutes(2));
  lines = Lines(metrics);
  for (const std::string& line : lines) EXPECT_THAT(line, Not(HasSubstr("stalled")));
}

TEST(TrainingMetricsTest, GpuInfoForEachGpuOfARunningRank) {
  TrainingMetrics metrics;
  std::vector<RunningRank> running = {
      {.job_id = "job-1", .rank = 0, .gpu = 2, .gpu_uuid = "GPU-cccc"},
      {.job_id = "job-1", .rank = 1, .gpu = 3, .gpu_uuid = "GPU-dddd"},
      {.job_id = "cpu-job", .rank = 0, .gpu = -1, .gpu_uuid = ""}};
  metrics.SetRunningRanks("node-7", [&running] { return running; });
  auto lines = Lines(metrics);
  EXPECT_THAT(lines, Contains("# TYPE tessera_task_gpu_info gauge"));
  EXPECT_THAT(lines, Contains("tessera_task_gpu_info{job_id=\"job-1\",rank=\"0\",node=\"node-7\","
                              "gpu=\"2\",UUID=\"GPU-cccc\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_task_gpu_info{job_id=\"job-1\",rank=\"1\",node=\"node-7\","
                              "gpu=\"3\",UUID=\"GPU-dddd\"} 1"));
  for (const std::string& line : lines) EXPECT_THAT(line, Not(HasSubstr("cpu-job")));
  // A rank that ended holds its GPU no more.
  running.erase(running.begin());
  lines = Lines(metrics);
  for (const std::string& line : lines) EXPECT_THAT(line, Not(HasSubstr("GPU-cccc")));
  EXPECT_THAT(lines, Contains(HasSubstr("GPU-dddd")));
}

}  // namespace
}  // namespace tessera::worker
