// The Store's rows keyed by step (store_metrics.cc): metric points and evaluations, checkpoint
// records and their retention.
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <algorithm>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::SizeIs;

TEST_P(StoreBackendTest, MetricPointsAreKeyedByStep) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_RUNNING, 2));

  JobWrite write;
  write.job_id = "job-a";
  for (int step = 1; step <= 5; ++step) write.metrics.push_back(Metrics(step, 10.0 - step));
  ASSERT_THAT(store->Commit(write), IsOk());
  // The same batch relayed again, with step 3 revised: still one point per step.
  write.metrics[2].set_loss(1.5);
  ASSERT_THAT(store->Commit(write), IsOk());
  JobWrite other;
  other.job_id = "job-b";
  other.metrics.push_back(Metrics(3, 99));
  ASSERT_THAT(store->Commit(other), IsOk());

  absl::StatusOr<std::vector<v1::StepMetrics>> all = store->ReadMetrics("job-a", 0, 0);
  ASSERT_THAT(all, IsOk());
  ASSERT_THAT(*all, SizeIs(5));
  for (int i = 0; i < 5; ++i) EXPECT_EQ((*all)[i].step(), i + 1);
  EXPECT_DOUBLE_EQ((*all)[2].loss(), 1.5);
  EXPECT_DOUBLE_EQ((*all)[4].loss(), 5.0);

  absl::StatusOr<std::vector<v1::StepMetrics>> range = store->ReadMetrics("job-a", 2, 4);
  ASSERT_THAT(range, IsOk());
  ASSERT_THAT(*range, SizeIs(3));
  EXPECT_EQ(range->front().step(), 2);
  EXPECT_EQ(range->back().step(), 4);

  JobWrite evals;
  evals.job_id = "job-a";
  for (int step : {10, 20, 10}) {
    v1::EvalMetrics eval;
    eval.set_step(step);
    eval.set_loss(step / 10.0);
    evals.evals.push_back(eval);
  }
  ASSERT_THAT(store->Commit(evals), IsOk());
  absl::StatusOr<std::vector<v1::EvalMetrics>> read_evals = store->ReadEvals("job-a", 15, 0);
  ASSERT_THAT(read_evals, IsOk());
  ASSERT_THAT(*read_evals, SizeIs(1));
  EXPECT_EQ(read_evals->front().step(), 20);
  read_evals = store->ReadEvals("job-a", 0, 0);
  ASSERT_THAT(read_evals, IsOk());
  EXPECT_THAT(*read_evals, SizeIs(2));
}

TEST_P(StoreBackendTest, CheckpointsNewestFirstAndRetention) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  JobWrite write;
  write.job_id = "job-a";
  for (int step : {100, 300, 200}) {
    v1::Checkpoint checkpoint;
    checkpoint.set_step(step);
    checkpoint.set_path("/ckpt/job-a/step-" + std::to_string(step));
    write.checkpoints.push_back(checkpoint);
  }
  ASSERT_THAT(store->Commit(write), IsOk());

  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-a");
  ASSERT_THAT(checkpoints, IsOk());
  ASSERT_THAT(*checkpoints, SizeIs(3));
  EXPECT_EQ((*checkpoints)[0].step(), 300);
  EXPECT_EQ((*checkpoints)[1].step(), 200);
  EXPECT_EQ((*checkpoints)[2].step(), 100);
  EXPECT_EQ((*checkpoints)[0].job_id(), "job-a");
  EXPECT_EQ((*checkpoints)[0].path(), "/ckpt/job-a/step-300");

  // A new checkpoint and the retention of the two oldest, in one write.
  JobWrite retain;
  retain.job_id = "job-a";
  retain.checkpoints.emplace_back().set_step(400);
  retain.retired_checkpoints = {{100, absl::FromUnixSeconds(10)}, {200, absl::FromUnixSeconds(10)}};
  ASSERT_THAT(store->Commit(retain), IsOk());
  checkpoints = store->ListCheckpoints("job-a");
  ASSERT_THAT(checkpoints, IsOk());
  ASSERT_THAT(*checkpoints, SizeIs(2));
  EXPECT_EQ((*checkpoints)[0].step(), 400);
  EXPECT_EQ((*checkpoints)[1].step(), 300);
  checkpoints = store->ListCheckpoints("job-other");
  ASSERT_THAT(checkpoints, IsOk());
  EXPECT_THAT(*checkpoints, IsEmpty());
}

// Reports come late and out of order: a replaced attempt's, relayed after its partition healed,
// may name a checkpoint that a newer attempt's retention has deleted since, or an older copy of
// a step written again since. Neither comes back into the list; a checkpoint created after its
// step was retired (a rollback that trains past it again) does.
TEST_P(StoreBackendTest, LateReportsOfDeletedOrReplacedCheckpointsStayOut) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  auto checkpoint_at = [](int64_t step, int64_t created_seconds) {
    v1::Checkpoint checkpoint;
    checkpoint.set_step(step);
    checkpoint.set_path(absl::StrCat("/ckpt/job-a/step-", step, "@", created_seconds));
    *checkpoint.mutable_create_time() = TimeUtil::SecondsToTimestamp(created_seconds);
    return checkpoint;
  };
  auto commit = [&](std::vector<v1::Checkpoint> checkpoints,
                    std::vector<CheckpointRetirement> retired) {
    JobWrite write;
    write.job_id = "job-a";
    write.checkpoints = std::move(checkpoints);
    write.retired_checkpoints = std::move(retired);
    return store->Commit(write).status();
  };
  auto listed = [&] {
    std::vector<std::string> paths;
    absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-a");
    EXPECT_THAT(checkpoints, IsOk());
    if (checkpoints.ok()) {
      for (const v1::Checkpoint& checkpoint : *checkpoints) paths.push_back(checkpoint.path());
    }
    return paths;
  };
  // Attempt 1 committed step 70 at t=100 (its report is held back); attempt 2 commits 80 at
  // t=200 and 90 at t=300, whose retention (keep_last 2) deletes 70.
  ASSERT_THAT(commit({checkpoint_at(80, 200)}, {}), IsOk());
  ASSERT_THAT(commit({checkpoint_at(90, 300)}, {{70, absl::FromUnixSeconds(300)}}), IsOk());
  // The held-back report of 70 arrives: deleted before it arrived, it stays out.
  ASSERT_THAT(commit({checkpoint_at(70, 100)}, {}), IsOk());
  EXPECT_THAT(listed(), ElementsAre("/ckpt/job-a/step-90@300", "/ckpt/job-a/step-80@200"));
  // A late retirement of a record created after it (step 80 written again at t=400 by a
  // rollback, then the retirement of its first copy, made at t=250, arrives) leaves it listed.
  ASSERT_THAT(commit({checkpoint_at(80, 400)}, {}), IsOk());
  ASSERT_THAT(commit({}, {{80, absl::FromUnixSeconds(250)}}), IsOk());
  // A late report of the first copy of 80 does not replace the newer one.
  ASSERT_THAT(commit({checkpoint_at(80, 200)}, {}), IsOk());
  EXPECT_THAT(listed(), ElementsAre("/ckpt/job-a/step-90@300", "/ckpt/job-a/step-80@400"));
  // Step 70 trained again after a rollback (created t=500, after its retirement): listed again.
  ASSERT_THAT(commit({checkpoint_at(70, 500)}, {}), IsOk());
  EXPECT_THAT(listed(), ElementsAre("/ckpt/job-a/step-90@300", "/ckpt/job-a/step-80@400",
                                    "/ckpt/job-a/step-70@500"));
  // Records never carry the report's retired steps.
  v1::Checkpoint reported = checkpoint_at(100, 600);
  reported.add_retired_steps(70);
  ASSERT_THAT(commit({reported}, {{70, absl::FromUnixSeconds(600)}}), IsOk());
  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-a");
  ASSERT_THAT(checkpoints, IsOk());
  ASSERT_THAT(*checkpoints, SizeIs(3));
  EXPECT_EQ((*checkpoints)[0].step(), 100);
  EXPECT_EQ((*checkpoints)[0].retired_steps_size(), 0);
}

TEST_P(StoreBackendTest, MetricsCompleteThroughIsTheEndOfTheFirstRunWithoutAGap) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_RUNNING, 2));
  auto commit = [&](const std::string& job_id, std::vector<int> steps) {
    JobWrite write;
    write.job_id = job_id;
    for (int step : steps) write.metrics.push_back(Metrics(step, 1.0));
    ASSERT_THAT(store->Commit(write), IsOk());
  };
  auto complete = [&](const std::string& job_id, int64_t up_to) -> int64_t {
    absl::StatusOr<int64_t> h = store->MetricsCompleteThrough(job_id, up_to);
    EXPECT_THAT(h, IsOk());
    return h.ok() ? *h : -1;
  };
  // No points at all.
  EXPECT_EQ(complete("job-a", 0), 0);
  // A gap at the start: step 1 missing.
  commit("job-a", {2, 3, 4});
  EXPECT_EQ(complete("job-a", 0), 0);
  // Steps of another job do not fill it.
  commit("job-b", {1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_EQ(complete("job-a", 0), 0);
  EXPECT_EQ(complete("job-b", 0), 9);
  // A gap in the middle: 1..4, then 7..9.
  commit("job-a", {1, 7, 8, 9});
  EXPECT_EQ(complete("job-a", 0), 4);
  // None: the gap filled (a backfill's points, stored by step).
  commit("job-a", {5, 6});
  EXPECT_EQ(complete("job-a", 0), 9);
  // Bounded: looks no further than the bound.
  EXPECT_EQ(complete("job-a", 6), 6);
  EXPECT_EQ(complete("job-a", 100), 9);
}

// The mark Commit keeps (step_metrics_complete) against the first gap counted from a set of the
// steps written: 600 steps in batches of 1-12 consecutive steps written in a shuffled order,
// some batches twice (a report relayed again, a replay), checked after every write. Long gaps
// open and close in any order, so a write fills a gap with points stored beyond it.
TEST_P(StoreBackendTest, MetricsCompleteThroughFollowsShuffledWrites) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  std::mt19937 random(45);
  std::vector<std::vector<int64_t>> batches;
  for (int64_t first = 1; first <= 600;) {
    const int64_t size = std::uniform_int_distribution<int64_t>(1, 12)(random);
    std::vector<int64_t>& batch = batches.emplace_back();
    for (int64_t step = first; step < first + size && step <= 600; ++step) batch.push_back(step);
    first += size;
  }
  const size_t distinct = batches.size();
  for (size_t i = 0; i < distinct; i += 7) batches.push_back(batches[i]);
  std::shuffle(batches.begin(), batches.end(), random);

  std::set<int64_t> written;
  for (const std::vector<int64_t>& batch : batches) {
    JobWrite write;
    write.job_id = "job-a";
    for (int64_t step : batch) {
      write.metrics.push_back(Metrics(step, 1.0));
      written.insert(step);
    }
    ASSERT_THAT(store->Commit(write), IsOk());
    int64_t expected = 0;
    while (written.count(expected + 1) > 0) ++expected;
    ASSERT_THAT(store->MetricsCompleteThrough("job-a", 0), IsOkAndHolds(expected))
        << "after writing steps " << batch.front() << ".." << batch.back();
    ASSERT_THAT(store->MetricsCompleteThrough("job-a", 300),
                IsOkAndHolds(std::min<int64_t>(expected, 300)));
  }
  EXPECT_THAT(store->MetricsCompleteThrough("job-a", 0), IsOkAndHolds(600));
  // The mark is the job's: another job's steps leave it, and its own, alone.
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_RUNNING, 2));
  EXPECT_THAT(store->MetricsCompleteThrough("job-b", 0), IsOkAndHolds(0));
  JobWrite other;
  other.job_id = "job-b";
  other.metrics = {Metrics(1, 1.0), Metrics(2, 1.0), Metrics(601, 1.0)};
  ASSERT_THAT(store->Commit(other), IsOk());
  EXPECT_THAT(store->MetricsCompleteThrough("job-b", 0), IsOkAndHolds(2));
  EXPECT_THAT(store->MetricsCompleteThrough("job-a", 0), IsOkAndHolds(600));
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreBackendTest, kStoreBackends, StoreBackendName);

}  // namespace
}  // namespace tessera::coordinator
