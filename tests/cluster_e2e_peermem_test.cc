// Recovery from peers' memory end to end (worker/shard_cache.h, trainer/io/memory_restore.h): the
// real coordinator, workers and trainers on loopback. A killed rank's restarted attempt resumes
// from the workers' memory with the losses of an undisturbed run; a lost worker's shards come from
// the copy its peer kept; a worker that lost its memory (restarted) makes the attempt read the
// checkpoint from storage. Each worker counts its trainers' restores by source in
// tessera_checkpoint_restores_total, which these tests read.
#include <signal.h>

#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster_e2e_fixture.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// tessera_checkpoint_restores_total{source=`source`} of the worker at `metrics_port`; -1 when the
// page or the series is missing.
int64_t Restores(int metrics_port, const std::string& source) {
  auto page = testing::HttpGet(metrics_port, "/metrics");
  if (!page.ok()) return -1;
  std::smatch match;
  if (!std::regex_search(page->body, match,
                         std::regex("tessera_checkpoint_restores_total\\{source=\"" + source +
                                    "\"\\} (\\S+)"))) {
    return -1;
  }
  return static_cast<int64_t>(std::stod(match[1]));
}

// The log of `rank` of `attempt` on `node` (the worker's per-rank file); "" when missing.
std::string RankLog(const std::string& root, const std::string& node, const std::string& job_id,
                    int attempt, int rank) {
  absl::StatusOr<std::string> log = ReadWholeFile(
      absl::StrCat(root, "/", node, "/jobs/", job_id, "/attempt-", attempt, "/rank-", rank, ".log"));
  return log.ok() ? *log : "";
}

TEST_F(TwoWorkerClusterTest, AKilledRankResumesFromMemoryWithTheLossesOfAnUndisturbedRun) {
  constexpr int kSteps = 40;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForCheckpoint(job_id, 10, 120)) << Get(job_id).ShortDebugString();
  std::vector<pid_t> node2 = TrainerPids(dir_.path() + "/e2e-node-2/jobs/" + job_id);
  ASSERT_EQ(node2.size(), 1u);
  ASSERT_EQ(kill(node2[0], SIGKILL), 0);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_GE(job.attempts(1).start_step(), 10);
  // Both ranks of the second attempt restored from memory, none from storage.
  EXPECT_EQ(Restores(worker_metrics_port_, "memory") + Restores(worker2_metrics_port_, "memory"),
            2);
  EXPECT_EQ(Restores(worker_metrics_port_, "storage") + Restores(worker2_metrics_port_, "storage"),
            0);
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

TEST_F(TwoWorkerClusterTest, ALostWorkersShardsComeFromThePeersCopy) {
  constexpr int kSteps = 40;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(1);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForCheckpoint(job_id, 10, 120)) << Get(job_id).ShortDebugString();
  // The worker goes with its memory; its rank's shard survives only in e2e-node's copy.
  ASSERT_THAT(worker2_->Stop(SIGKILL), IsOk());
  worker2_.reset();
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_EQ(job.attempts_size(), 2);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node e2e-node-2 was lost"));
  EXPECT_EQ(job.attempts(1).world_size(), 1);
  EXPECT_GE(job.attempts(1).start_step(), 10);
  // The one rank left read both shards of the two-rank checkpoint from its worker's memory: its
  // own node's, and e2e-node-2's, which that worker had copied there.
  EXPECT_EQ(Restores(worker_metrics_port_, "memory"), 1) << worker_->stderr_text();
  EXPECT_EQ(Restores(worker_metrics_port_, "storage"), 0);
  const std::string log = RankLog(dir_.path(), "e2e-node", job_id, 1, 0);
  EXPECT_THAT(log, HasSubstr("(from memory"));
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(curve[i].step(), i + 1);
}

TEST_F(ClusterTest, WithoutAMemoryCopyTheAttemptResumesFromStorage) {
  constexpr int kSteps = 40;
  v1::JobSpec spec = Spec(kSteps);
  spec.set_max_restarts(2);
  const std::string job_id = Submit(spec);
  ASSERT_TRUE(WaitForCheckpoint(job_id, 10, 120)) << Get(job_id).ShortDebugString();
  // The only worker restarts: its trainers and its memory are gone, the checkpoint on storage
  // stays.
  ASSERT_THAT(worker_->Stop(SIGKILL), IsOk());
  worker_.reset();
  StartWorker(0, 1);
  v1::Job job = WaitFor(job_id, v1::JOB_STATE_SUCCEEDED, 240);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason() << "\n" << worker_->stderr_text();
  ASSERT_GE(job.attempts_size(), 2);
  EXPECT_GE(job.attempts(job.attempts_size() - 1).start_step(), 10);
  EXPECT_EQ(Restores(worker_metrics_port_, "storage"), 2) << worker_->stderr_text();
  EXPECT_EQ(Restores(worker_metrics_port_, "memory"), 0);
  EXPECT_THAT(RankLog(dir_.path(), "e2e-node", job_id, job.attempts_size() - 1, 0),
              HasSubstr("not restored from memory"));
  std::vector<v1::StepMetrics> curve = Curve(job_id);
  ASSERT_EQ(curve.size(), static_cast<size_t>(kSteps));
  ExpectTheLossesOfAnUninterruptedRun(spec, curve);
}

}  // namespace
}  // namespace tessera
