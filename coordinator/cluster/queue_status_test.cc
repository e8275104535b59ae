// Coordinator.ListQueues' answer: QueueStatuses over hand-made figures, and a Cluster on simulated
// time that counts each queue's jobs after its passes and tells how long each placed job waited in
// its queue.
#include "coordinator/cluster/queue_status.h"

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/cluster/cluster_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::Pair;
using ::testing::SizeIs;

TEST(QueueStatusesTest, EveryConfiguredQueueByNameWithItsQuotaAndFigures) {
  QueueConfig config;
  config.cohorts = {"lab"};
  config.queues = {{.name = "vision", .cohort = "lab", .nominal = {.gpus = 8}, .weight = 2},
                   {.name = "nlp",
                    .cohort = "lab",
                    .nominal = {.gpus = 8, .cpu_slots = 4},
                    .borrowing_limit_gpus = 4}};
  ClusterStats::QueueFigures nlp;
  nlp.used = {.gpus = 12, .cpu_slots = 1};
  nlp.borrowed = {.gpus = 4};
  nlp.waiting_jobs = 2;
  nlp.running_jobs = 3;
  nlp.fair_share = 0.75;
  nlp.preemptions = {{"reclaim", 2}, {"priority", 1}};
  const v1::ListQueuesResponse response =
      QueueStatuses(config, {{"nlp", nlp}, {"gone", nlp}}, "/etc/queues.yaml");

  EXPECT_EQ(response.queue_file(), "/etc/queues.yaml");
  ASSERT_THAT(response.queues(), SizeIs(2)) << "a queue no longer configured is not listed";
  const v1::QueueStatus& first = response.queues(0);
  EXPECT_EQ(first.name(), "nlp");
  EXPECT_EQ(first.cohort(), "lab");
  EXPECT_EQ(first.nominal().gpus(), 8);
  EXPECT_EQ(first.nominal().cpu_slots(), 4);
  ASSERT_TRUE(first.has_borrowing_limit_gpus());
  EXPECT_EQ(first.borrowing_limit_gpus(), 4);
  EXPECT_FALSE(first.has_borrowing_limit_cpu_slots());
  EXPECT_EQ(first.used().gpus(), 12);
  EXPECT_EQ(first.used().cpu_slots(), 1);
  EXPECT_EQ(first.borrowed().gpus(), 4);
  EXPECT_EQ(first.weight(), 1.0);
  EXPECT_EQ(first.fair_share(), 0.75);
  EXPECT_EQ(first.pending_jobs(), 2);
  EXPECT_EQ(first.running_jobs(), 3);
  EXPECT_EQ(first.preemptions(), 3);
  // No figures yet (before the first pass): zeros, the quota as configured.
  const v1::QueueStatus& second = response.queues(1);
  EXPECT_EQ(second.name(), "vision");
  EXPECT_EQ(second.weight(), 2.0);
  EXPECT_EQ(second.nominal().gpus(), 8);
  EXPECT_EQ(second.used().gpus(), 0);
  EXPECT_EQ(second.running_jobs(), 0);
}

TEST(QueueStatusesTest, WithoutQueuesOneImplicitQueueWithoutQuota) {
  ClusterStats::QueueFigures figures;
  figures.used = {.cpu_slots = 2};
  figures.running_jobs = 1;
  const v1::ListQueuesResponse response =
      QueueStatuses(QueueConfig{}, {{std::string(kImplicitQueue), figures}}, "");
  EXPECT_EQ(response.queue_file(), "");
  ASSERT_THAT(response.queues(), SizeIs(1));
  EXPECT_EQ(response.queues(0).name(), "default");
  EXPECT_EQ(response.queues(0).nominal().cpu_slots(), 0);
  EXPECT_EQ(response.queues(0).used().cpu_slots(), 2);
  EXPECT_EQ(response.queues(0).running_jobs(), 1);
}

// Without a queue file the cluster lists the implicit queue with its devices and jobs; each job
// placed is observed with its wait: from its submission for attempt 0, from the end of the
// previous attempt for a restart.
TEST_F(ClusterTest, ImplicitQueueCountsJobsAndWaitsFromSubmissionOrThePreviousAttempt) {
  std::vector<std::pair<std::string, double>> waits;
  cluster_->SetQueueWaitObserver(
      [&](const std::string& queue, double seconds) { waits.emplace_back(queue, seconds); });
  const std::string job_id = Submit(CpuSpec(2, 1));
  const std::string waiting = Submit(CpuSpec(2, 0));
  clock_.Advance(absl::Seconds(30));
  cluster_->Tick();
  v1::ListQueuesResponse queues = cluster_->ListQueues();
  ASSERT_THAT(queues.queues(), SizeIs(1));
  EXPECT_EQ(queues.queues(0).name(), "default");
  EXPECT_EQ(queues.queues(0).pending_jobs(), 2) << "no node yet";
  EXPECT_EQ(queues.queues(0).running_jobs(), 0);

  Register("n1", 2);
  clock_.Advance(absl::Seconds(10));
  cluster_->Tick();
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(waits, ElementsAre(Pair("default", 40.0)));
  queues = cluster_->ListQueues();
  EXPECT_EQ(queues.queues(0).running_jobs(), 1);
  EXPECT_EQ(queues.queues(0).pending_jobs(), 1);
  EXPECT_EQ(queues.queues(0).used().cpu_slots(), 2);

  // Alone in the queue from here, so that the restart takes the slots back.
  ASSERT_THAT(jobs_->Cancel(waiting, "not needed").status(), IsOk());
  StartOn(job_id, 0, "n1");
  clock_.Advance(absl::Seconds(100));
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 0, "n1", Now());
  Beat("n1", {failed});
  clock_.Advance(absl::Seconds(1));  // the blame grace
  cluster_->Tick();
  ASSERT_EQ(Job(job_id).attempt(), 1);
  const absl::Time ended = absl::FromUnixNanos(
      google::protobuf::util::TimeUtil::TimestampToNanoseconds(Job(job_id).attempts(0).end_time()));
  for (int i = 0; i < 3 && Job(job_id).state() != v1::JOB_STATE_SCHEDULED; ++i) {
    clock_.Advance(absl::Seconds(5));
    cluster_->Tick();
  }
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED) << Job(job_id).reason();
  ASSERT_THAT(waits, SizeIs(2));
  EXPECT_EQ(waits[1].first, "default");
  EXPECT_EQ(waits[1].second, absl::ToDoubleSeconds(Now() - ended));
  EXPECT_LT(waits[1].second, 100) << "not counted from the submission";
}

// With a queue file: each queue's running and waiting jobs, the quota and the path.
TEST_F(ClusterTest, ConfiguredQueuesAreListedWithTheirRunningJobs) {
  ::tessera::testing::ScopedTempDir dir("queue-status");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << R"(
queues:
  - name: nlp
    nominal: {cpu_slots: 2}
  - name: vision
    nominal: {cpu_slots: 4}
default_queue: nlp
)";
  auto file = QueueFile::Create({.path = path, .clock = &clock_});
  ASSERT_THAT(file.status(), IsOk());
  std::unique_ptr<QueueFile> queue_file = std::move(*file);
  cluster_.reset();
  jobs_ = std::make_unique<JobManager>(store_.get(), &clock_, queue_file.get());
  ClusterOptions options;
  options.clock = &clock_;
  options.queues = queue_file.get();
  cluster_ = std::make_unique<Cluster>(store_.get(), jobs_.get(), options);
  std::vector<std::pair<std::string, double>> waits;
  cluster_->SetQueueWaitObserver(
      [&](const std::string& queue, double seconds) { waits.emplace_back(queue, seconds); });

  Register("n1", 8);
  const std::string first = Submit(CpuSpec(2, 0));
  const std::string second = Submit(CpuSpec(2, 0));
  clock_.Advance(absl::Seconds(7));
  const ClusterStats stats = cluster_->Tick();
  ASSERT_EQ(Job(first).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(Job(second).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(stats.queues.at("nlp").running_jobs, 1) << "in the pass's statistics (metrics)";
  EXPECT_THAT(waits, ElementsAre(Pair("nlp", 7.0)));

  // The pass counts devices and waiting jobs before it places, its running jobs after: the next
  // pass's figures agree.
  cluster_->Tick();
  const v1::ListQueuesResponse response = cluster_->ListQueues();
  EXPECT_EQ(response.queue_file(), path);
  ASSERT_THAT(response.queues(), SizeIs(2));
  const v1::QueueStatus& nlp = response.queues(0);
  EXPECT_EQ(nlp.name(), "nlp");
  EXPECT_EQ(nlp.nominal().cpu_slots(), 2);
  EXPECT_EQ(nlp.used().cpu_slots(), 2);
  EXPECT_EQ(nlp.running_jobs(), 1);
  EXPECT_EQ(nlp.pending_jobs(), 1);
  EXPECT_EQ(response.queues(1).name(), "vision");
  EXPECT_EQ(response.queues(1).running_jobs(), 0);
  EXPECT_EQ(response.queues(1).nominal().cpu_slots(), 4);
  cluster_.reset();  // before the queue file it reads
  jobs_.reset();
}

}  // namespace
}  // namespace tessera::coordinator
