// JobManager in-process: an in-memory store and a SimulatedClock, so the times it stores (create,
// start, end) are checked exactly.

#include "coordinator/jobs/job_manager.h"

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::tessera::testing::IsOk;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

absl::Time FromProto(const google::protobuf::Timestamp& timestamp) {
  return absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(timestamp));
}

google::protobuf::Timestamp ToProto(absl::Time time) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

v1::StepMetrics Point(int64_t step, double loss) {
  v1::StepMetrics point;
  point.set_step(step);
  point.set_loss(loss);
  return point;
}

class JobManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Open(":memory:");
    ASSERT_THAT(store.status(), IsOk());
    store_ = std::move(*store);
    jobs_ = std::make_unique<JobManager>(store_.get(), &clock_);
  }

  std::string Submit(const std::string& request_id = "", const std::string& owner = "alice") {
    auto job = jobs_->Submit(testing::TinyCpuJobSpec("job", 2, 0), request_id, owner);
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? job->job_id() : "";
  }

  v1::Job Job(const std::string& job_id) {
    auto job = jobs_->Get(job_id);
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? *job : v1::Job();
  }

  SimulatedClock clock_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
};

// The create, start and end times are the clock's at submission, at the first RUNNING and at the
// end; a terminal job moves no more.
TEST_F(JobManagerTest, StoredTimesComeFromTheClock) {
  const absl::Time submitted = clock_.Now();
  const std::string job_id = Submit();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(FromProto(Job(job_id).create_time()), submitted);

  clock_.Advance(absl::Seconds(5));
  ASSERT_THAT(jobs_->Transition(job_id, v1::JOB_STATE_RUNNING, "up").status(), IsOk());
  EXPECT_EQ(FromProto(Job(job_id).start_time()), submitted + absl::Seconds(5));
  clock_.Advance(absl::Seconds(5));
  ASSERT_THAT(jobs_->Transition(job_id, v1::JOB_STATE_RUNNING, "still up").status(), IsOk());
  EXPECT_EQ(FromProto(Job(job_id).start_time()), submitted + absl::Seconds(5))
      << "the first RUNNING is the start";
  EXPECT_FALSE(Job(job_id).has_end_time());

  clock_.Advance(absl::Seconds(1));
  ASSERT_THAT(jobs_->Cancel(job_id, "test").status(), IsOk());
  const v1::Job cancelled = Job(job_id);
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(FromProto(cancelled.end_time()), submitted + absl::Seconds(11));
  EXPECT_TRUE(absl::IsFailedPrecondition(
      jobs_->Transition(job_id, v1::JOB_STATE_RUNNING, "again").status()));
  auto again = jobs_->Cancel(job_id, "twice");
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(FromProto(again->end_time()), submitted + absl::Seconds(11)) << "returned unchanged";
}

// A request id returns its owner's job again, never another owner's.
TEST_F(JobManagerTest, RequestIdsArePerOwner) {
  const std::string first = Submit("r1", "alice");
  EXPECT_EQ(Submit("r1", "alice"), first);
  EXPECT_NE(Submit("r1", "bob"), first);
  EXPECT_NE(Submit("", "alice"), first);
}

// A batch stores every transition it can; a terminal job's fails alone, as does one whose
// precondition does not hold, and every transition of the batch carries the same time.
TEST_F(JobManagerTest, TransitionAllStoresWhatItCanAtOneTime) {
  const std::string a = Submit(), b = Submit(), c = Submit(), d = Submit();
  ASSERT_THAT(jobs_->Cancel(b, "test").status(), IsOk());
  clock_.Advance(absl::Minutes(1));
  auto attempt_is = [](int attempt) {
    return [attempt](const v1::Job& job) {
      return job.attempt() == attempt ? absl::OkStatus()
                                      : absl::FailedPreconditionError("another attempt");
    };
  };
  const std::vector<absl::StatusOr<v1::Job>> results = jobs_->TransitionAll(
      {{a, v1::JOB_STATE_RUNNING, "a runs", nullptr, attempt_is(0)},
       {b, v1::JOB_STATE_RUNNING, "b runs", nullptr, nullptr},
       {c, v1::JOB_STATE_FAILED, "c fails", [](v1::Job& job) { job.set_restarts(7); }, nullptr},
       {d, v1::JOB_STATE_PREEMPTED, "d yields", nullptr, attempt_is(3)}});
  ASSERT_THAT(results, SizeIs(4));
  EXPECT_THAT(results[0].status(), IsOk());
  EXPECT_TRUE(absl::IsFailedPrecondition(results[1].status()));
  EXPECT_THAT(results[2].status(), IsOk());
  EXPECT_TRUE(absl::IsFailedPrecondition(results[3].status()));
  EXPECT_EQ(Job(d).state(), v1::JOB_STATE_PENDING) << "nothing of it was stored";
  EXPECT_EQ(Job(a).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(b).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(Job(c).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(c).restarts(), 7);
  EXPECT_EQ(FromProto(Job(a).start_time()), clock_.Now());
  EXPECT_EQ(FromProto(Job(c).end_time()), clock_.Now());
}

// A conditional transition checks the job as it reads it: a precondition that fails is returned and
// nothing is stored; one that holds moves the job as Transition does.
TEST_F(JobManagerTest, TransitionIfMovesOnlyAJobItsPreconditionAccepts) {
  const std::string job_id = Submit();
  auto pending = [](const v1::Job& job) {
    return job.state() == v1::JOB_STATE_PENDING ? absl::OkStatus()
                                                : absl::FailedPreconditionError("not pending");
  };
  auto refused = jobs_->TransitionIf(
      job_id, [](const v1::Job&) { return absl::AbortedError("not now"); }, v1::JOB_STATE_RUNNING,
      "up");
  EXPECT_TRUE(absl::IsAborted(refused.status())) << refused.status();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_PENDING) << "nothing stored";
  EXPECT_THAT(jobs_
                  ->TransitionIf(job_id, pending, v1::JOB_STATE_RUNNING, "up",
                                 [](v1::Job& job) { job.set_restarts(2); })
                  .status(),
              IsOk());
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job_id).restarts(), 2);
  EXPECT_TRUE(absl::IsFailedPrecondition(
      jobs_->TransitionIf(job_id, pending, v1::JOB_STATE_RUNNING, "again").status()));
  EXPECT_TRUE(absl::IsNotFound(
      jobs_->TransitionIf("job-missing", pending, v1::JOB_STATE_RUNNING, "up").status()));
}

// Metric points at or below the current step (resent, or trained again after a restart) add no
// event; checkpoints move latest_checkpoint forward only.
TEST_F(JobManagerTest, RecordReportsAddsEachStepsEventOnce) {
  const std::string job_id = Submit();
  auto events = [&] {
    auto read = jobs_->Events(job_id, 0, 0);
    EXPECT_THAT(read.status(), IsOk());
    return read.ok() ? read->size() : 0u;
  };
  const size_t before = events();
  v1::Checkpoint newer, older;
  newer.set_step(2);
  older.set_step(1);
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(1, 3.0), Point(2, 2.5)}, {}, {newer}), IsOk());
  EXPECT_EQ(events(), before + 3);
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(2, 2.5)}, {}, {older}), IsOk());
  EXPECT_EQ(events(), before + 4) << "the resent step adds none; the checkpoint one";
  const v1::Job job = Job(job_id);
  EXPECT_EQ(job.current_step(), 2);
  EXPECT_EQ(job.latest_checkpoint().step(), 2);
  EXPECT_THAT(jobs_->RecordReports(job_id, {}, {}, {}), IsOk());
  EXPECT_EQ(events(), before + 4);
}

// A mixture of experts' routing: the job's latest_metrics keeps every layer's per-expert counts;
// the curve and the events keep each layer's imbalance, not the counts.
TEST_F(JobManagerTest, ExpertCountsStayInTheLatestMetricsAndImbalanceInTheCurve) {
  const std::string job_id = Submit();
  v1::StepMetrics point = Point(1, 3.0);
  for (int layer = 0; layer < 2; ++layer) {
    v1::ExpertLoad* load = point.add_expert_load();
    load->set_layer(layer);
    for (int64_t tokens : {6, 1, 1, 0}) load->add_tokens(tokens);
    load->set_imbalance(3.0);
  }
  ASSERT_THAT(jobs_->RecordReports(job_id, {point}, {}, {}), IsOk());
  const v1::Job job = Job(job_id);
  ASSERT_EQ(job.latest_metrics().expert_load_size(), 2);
  EXPECT_THAT(job.latest_metrics().expert_load(1).tokens(), ElementsAre(6, 1, 1, 0));
  absl::StatusOr<std::vector<v1::StepMetrics>> curve = store_->ReadMetrics(job_id, 0, 0);
  ASSERT_THAT(curve, IsOk());
  ASSERT_EQ(curve->size(), 1u);
  ASSERT_EQ(curve->front().expert_load_size(), 2);
  EXPECT_EQ(curve->front().expert_load(1).tokens_size(), 0);
  EXPECT_DOUBLE_EQ(curve->front().expert_load(1).imbalance(), 3.0);
  auto events = jobs_->Events(job_id, 0, 0);
  ASSERT_THAT(events.status(), IsOk());
  ASSERT_TRUE(events->back().has_metrics());
  EXPECT_EQ(events->back().metrics().expert_load(0).tokens_size(), 0);
}

// A checkpoint report names the checkpoints its commit's retention deleted: they leave the list
// in the same write, and the reported checkpoint is recorded without that list.
TEST_F(JobManagerTest, ACheckpointsRetiredStepsLeaveTheList) {
  const std::string job_id = Submit();
  std::vector<v1::Checkpoint> saved(3);
  for (int i = 0; i < 3; ++i) {
    saved[i].set_step(10 * (i + 1));
    *saved[i].mutable_create_time() = ToProto(clock_.Now() + absl::Seconds(i));
  }
  saved[2].add_retired_steps(10);
  ASSERT_THAT(jobs_->RecordReports(job_id, {}, {}, {saved[0], saved[1]}), IsOk());
  ASSERT_THAT(jobs_->RecordReports(job_id, {}, {}, {saved[2]}), IsOk());
  absl::StatusOr<std::vector<v1::Checkpoint>> listed = jobs_->Checkpoints(job_id);
  ASSERT_THAT(listed, IsOk());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].step(), 30);
  EXPECT_EQ((*listed)[0].retired_steps_size(), 0);
  EXPECT_EQ((*listed)[1].step(), 20);
  EXPECT_EQ(Job(job_id).latest_checkpoint().retired_steps_size(), 0);
}

// A resumed attempt's backfill (step_metrics_log.h): points of steps the record misses, below the
// current step, fill the gap without moving current_step or latest_metrics back or adding events.
TEST_F(JobManagerTest, BackfilledPointsBelowTheCurrentStepFillGapsOnly) {
  const std::string job_id = Submit();
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(1, 3.0), Point(2, 2.9), Point(6, 2.5)}, {}, {}),
              IsOk());
  auto read = jobs_->Events(job_id, 0, 0);
  ASSERT_THAT(read.status(), IsOk());
  const size_t before = read->size();
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(3, 2.8), Point(4, 2.7), Point(5, 2.6)}, {}, {}),
              IsOk());
  read = jobs_->Events(job_id, 0, 0);
  ASSERT_THAT(read.status(), IsOk());
  EXPECT_EQ(read->size(), before) << "backfilled steps add no event";
  const v1::Job job = Job(job_id);
  EXPECT_EQ(job.current_step(), 6);
  EXPECT_EQ(job.latest_metrics().step(), 6);
  EXPECT_DOUBLE_EQ(job.latest_metrics().loss(), 2.5);
  absl::StatusOr<int64_t> complete = store_->MetricsCompleteThrough(job_id, 0);
  ASSERT_THAT(complete, IsOk());
  EXPECT_EQ(*complete, 6);
}

// Fencing: what a replaced attempt relays late (a partitioned worker's queue) does not move the
// new attempt's record; its committed checkpoints are kept.
TEST_F(JobManagerTest, AReplacedAttemptsMetricsAreDroppedAndItsCheckpointsKept) {
  const std::string job_id = Submit();
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(1, 3.0), Point(2, 2.9)}, {}, {}, 0), IsOk());
  ASSERT_THAT(jobs_
                  ->Transition(job_id, v1::JOB_STATE_RESTARTING, "a node was lost",
                               [](v1::Job& job) {
                                 job.set_attempt(job.attempt() + 1);
                                 job.set_current_step(2);
                               })
                  .status(),
              IsOk());
  v1::Checkpoint checkpoint;
  checkpoint.set_step(4);
  checkpoint.set_path("/ckpt/step-00000004");
  v1::EvalMetrics eval;
  eval.set_step(4);
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(3, 9.0), Point(4, 9.0)}, {eval}, {checkpoint}, 0),
              IsOk());
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.current_step(), 2);
  EXPECT_EQ(job.latest_metrics().step(), 2);
  EXPECT_EQ(job.latest_checkpoint().step(), 4) << "a committed checkpoint is a checkpoint";
  auto points = store_->ReadMetrics(job_id, 0, 0);
  ASSERT_THAT(points.status(), IsOk());
  EXPECT_EQ(points->size(), 2u) << "attempt 0's steps 3 and 4 are not the record";
  auto evals = store_->ReadEvals(job_id, 0, 0);
  ASSERT_THAT(evals.status(), IsOk());
  EXPECT_TRUE(evals->empty());
  // The new attempt's own reports, and reports without an attempt (a standalone caller), count.
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(3, 2.8)}, {}, {}, 1), IsOk());
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(4, 2.7)}, {}, {}), IsOk());
  job = Job(job_id);
  EXPECT_EQ(job.current_step(), 4);
  EXPECT_DOUBLE_EQ(job.latest_metrics().loss(), 2.7);
}

// The commit observer sees every committed change, as stored, in commit order: submission,
// single and batched transitions, reports; a refused change is not seen.
TEST_F(JobManagerTest, CommitObserverSeesEachCommittedChangeAsStored) {
  std::vector<v1::Job> seen;
  jobs_->SetCommitObserver([&](const v1::Job& job) { seen.push_back(job); });
  const std::string job_id = Submit();
  ASSERT_THAT(jobs_->Transition(job_id, v1::JOB_STATE_RUNNING, "up").status(), IsOk());
  v1::Checkpoint checkpoint;
  checkpoint.set_step(1);
  ASSERT_THAT(jobs_->RecordReports(job_id, {Point(1, 3.0)}, {}, {checkpoint}), IsOk());
  const auto batch =
      jobs_->TransitionAll({{job_id, v1::JOB_STATE_SUCCEEDED, "done", nullptr, nullptr}});
  ASSERT_THAT(batch[0].status(), IsOk());
  EXPECT_FALSE(jobs_->Transition(job_id, v1::JOB_STATE_RUNNING, "again").ok());
  ASSERT_THAT(seen, SizeIs(4));
  EXPECT_EQ(seen[0].job_id(), job_id);
  EXPECT_EQ(seen[0].state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(seen[1].state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(seen[2].current_step(), 1);
  EXPECT_EQ(seen[2].latest_checkpoint().step(), 1);
  EXPECT_EQ(seen[3].state(), v1::JOB_STATE_SUCCEEDED);
  jobs_->SetCommitObserver(nullptr);
  Submit();
  EXPECT_THAT(seen, SizeIs(4)) << "a removed observer hears nothing";
}

// Watchers hear of their job's changes only, until they unsubscribe; CloseWatches calls each
// once more.
TEST_F(JobManagerTest, WatchersHearOfTheirJobUntilUnsubscribed) {
  const std::string watched = Submit(), other = Submit();
  int calls = 0;
  const int64_t handle = jobs_->Subscribe(watched, [&] { ++calls; });
  ASSERT_THAT(jobs_->Transition(other, v1::JOB_STATE_RUNNING, "x").status(), IsOk());
  EXPECT_EQ(calls, 0);
  ASSERT_THAT(jobs_->Transition(watched, v1::JOB_STATE_RUNNING, "x").status(), IsOk());
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(jobs_->closed());
  jobs_->CloseWatches();
  EXPECT_TRUE(jobs_->closed());
  EXPECT_EQ(calls, 2);
  jobs_->Unsubscribe(handle);
  ASSERT_THAT(jobs_->Cancel(watched, "x").status(), IsOk());
  EXPECT_EQ(calls, 2);
}

// Each job goes to a queue at submission: the one it names if its owner may submit there, else
// its owner's default; an unknown queue, a queue the owner may not use and a gang the quota can
// never hold are refused with the status that fits. Without a queue file everything goes to the
// implicit queue.
TEST_F(JobManagerTest, SubmissionsAreRoutedToTheirQueue) {
  EXPECT_EQ(Job(Submit()).queue(), "default");

  ::tessera::testing::ScopedTempDir dir("job-manager-queues");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << R"(
cohorts:
  - name: lab
queues:
  - name: nlp
    cohort: lab
    nominal: {cpu_slots: 4}
    borrowing_limit: {cpu_slots: 0}
    submitters: {users: [alice]}
    default_for: {users: [alice]}
  - name: shared
    cohort: lab
    nominal: {cpu_slots: 2}
default_queue: shared
)";
  auto queues = QueueFile::Create({.path = path, .clock = &clock_});
  ASSERT_THAT(queues.status(), IsOk());
  JobManager jobs(store_.get(), &clock_, queues->get());
  auto submit = [&](const std::string& owner, const std::string& queue, int slots) {
    v1::JobSpec spec = testing::TinyCpuJobSpec("queued", slots, 0);
    spec.set_queue(queue);
    spec.mutable_batch()->set_global_batch_size(4 * slots);
    return jobs.Submit(spec, "", owner);
  };
  auto alice = submit("alice", "", 2);
  ASSERT_THAT(alice.status(), IsOk());
  EXPECT_EQ(alice->queue(), "nlp");
  EXPECT_EQ(Job(alice->job_id()).queue(), "nlp");
  auto bob = submit("bob", "", 2);
  ASSERT_THAT(bob.status(), IsOk());
  EXPECT_EQ(bob->queue(), "shared");
  auto named = submit("alice", "shared", 2);
  ASSERT_THAT(named.status(), IsOk());
  EXPECT_EQ(named->queue(), "shared");

  EXPECT_THAT(submit("alice", "robotics", 2).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("queue: queue 'robotics'")));
  EXPECT_THAT(submit("bob", "nlp", 2).status(),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("queue: ")));
  // nlp may use 4 CPU slots and borrow none: a gang of 8 could never start.
  EXPECT_THAT(submit("alice", "nlp", 8).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("queue: needs 8")));
}

}  // namespace
}  // namespace tessera::coordinator
