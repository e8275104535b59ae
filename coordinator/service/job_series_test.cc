// JobSeries: the per-job families as a scrape sees them, as jobs start, report, stall and end.
#include "coordinator/service/job_series.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace tessera::coordinator {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

std::vector<std::string> Lines(const JobSeries& series) {
  return absl::StrSplit(prometheus::TextSerializer().Serialize(series.Collect()), '\n',
                        absl::SkipEmpty());
}

v1::StragglerReport Report(std::vector<double> busy, double skew) {
  v1::StragglerReport report;
  for (size_t rank = 0; rank < busy.size(); ++rank) {
    v1::RankStepTime* time = report.add_ranks();
    time->set_rank(static_cast<int>(rank));
    time->set_busy_seconds(busy[rank]);
  }
  report.set_skew(skew);
  return report;
}

TEST(JobSeriesTest, NothingIsServedBeforeAJobRuns) {
  JobSeries series;
  EXPECT_THAT(series.Collect(), IsEmpty());
}

TEST(JobSeriesTest, ARunningJobsTimestampsMoveAndGoWhenItLeavesRunning) {
  JobSeries series;
  series.SetRunning("job-b", std::nullopt, std::nullopt);
  series.SetRunning("job-a", 1700000000.5, std::nullopt);
  std::vector<std::string> lines = Lines(series);
  EXPECT_THAT(lines, Contains("# TYPE tessera_job_running gauge"));
  EXPECT_THAT(lines, Contains("tessera_job_running{job_id=\"job-a\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_job_running{job_id=\"job-b\"} 1"));
  EXPECT_THAT(lines, Contains("tessera_job_last_step_timestamp_seconds{job_id=\"job-a\"} "
                              "1700000000.5"));
  EXPECT_THAT(lines, Not(Contains(HasSubstr("tessera_job_last_checkpoint_timestamp_seconds"))));

  // A commit without a step point keeps the last one; a checkpoint adds its series.
  series.SetRunning("job-a", std::nullopt, 1699990000);
  lines = Lines(series);
  EXPECT_THAT(lines, Contains("tessera_job_last_step_timestamp_seconds{job_id=\"job-a\"} "
                              "1700000000.5"));
  EXPECT_THAT(lines, Contains("tessera_job_last_checkpoint_timestamp_seconds{job_id=\"job-a\"} "
                              "1699990000"));

  series.DropRunning("job-a");
  lines = Lines(series);
  EXPECT_THAT(lines, Not(Contains(HasSubstr("job-a"))));
  EXPECT_THAT(lines, Contains("tessera_job_running{job_id=\"job-b\"} 1"));
  series.DropRunning("job-b");
  series.DropRunning("job-never-seen");
  EXPECT_THAT(series.Collect(), IsEmpty());
}

TEST(JobSeriesTest, StragglerSeriesAreThoseOfTheLatestReports) {
  JobSeries series;
  series.SetStragglers({{"job-a", Report({0.5, 0.75}, 1.2)}, {"job-b", Report({0.25}, 1)}});
  std::vector<std::string> lines = Lines(series);
  EXPECT_THAT(lines, Contains("tessera_rank_step_seconds{job_id=\"job-a\",rank=\"1\"} 0.75"));
  EXPECT_THAT(lines, Contains("tessera_rank_step_seconds{job_id=\"job-b\",rank=\"0\"} 0.25"));
  EXPECT_THAT(lines, Contains("tessera_job_straggler_skew{job_id=\"job-a\"} 1.2"));

  series.SetStragglers({{"job-b", Report({0.5}, 1)}});
  lines = Lines(series);
  EXPECT_THAT(lines, Not(Contains(HasSubstr("job-a"))));
  EXPECT_THAT(lines, Contains("tessera_rank_step_seconds{job_id=\"job-b\",rank=\"0\"} 0.5"));

  series.SetStragglers({});
  EXPECT_THAT(series.Collect(), IsEmpty());
}

TEST(JobSeriesTest, SeriesComeInLabelOrder) {
  JobSeries series;
  for (const char* job : {"job-c", "job-a", "job-b"}) series.SetRunning(job, 1, std::nullopt);
  std::vector<std::string> running;
  for (const std::string& line : Lines(series)) {
    if (line.starts_with("tessera_job_running{")) running.push_back(line);
  }
  EXPECT_THAT(running, ElementsAre("tessera_job_running{job_id=\"job-a\"} 1",
                                   "tessera_job_running{job_id=\"job-b\"} 1",
                                   "tessera_job_running{job_id=\"job-c\"} 1"));
}

}  // namespace
}  // namespace tessera::coordinator
