#include "coordinator/store.h"

#include <signal.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::tessera::testing::IsOkAndHolds;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

v1::Job MakeJob(const std::string& job_id, v1::JobState state, int64_t create_seconds) {
  v1::Job job;
  job.set_job_id(job_id);
  job.set_state(state);
  job.mutable_spec()->set_name("job-" + std::to_string(create_seconds));
  job.mutable_spec()->set_priority(static_cast<int32_t>(create_seconds % 3));
  job.mutable_create_time()->set_seconds(create_seconds);
  return job;
}

v1::JobEvent StateEvent(v1::JobState from, v1::JobState to) {
  v1::JobEvent event;
  event.mutable_state_change()->set_previous_state(from);
  event.mutable_state_change()->set_new_state(to);
  return event;
}

v1::StepMetrics Metrics(int64_t step, double loss) {
  v1::StepMetrics metrics;
  metrics.set_step(step);
  metrics.set_loss(loss);
  return metrics;
}

std::unique_ptr<Store> OpenOrDie(const std::string& path) {
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  EXPECT_THAT(store, IsOk());
  return store.ok() ? std::move(store).value() : nullptr;
}

// Submits a job with `events` state events (all PENDING -> PENDING).
void SubmitJob(Store& store, const v1::Job& job, int events = 0) {
  JobWrite write;
  write.job_id = job.job_id();
  write.job = job;
  for (int i = 0; i < events; ++i) {
    write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
  }
  ASSERT_THAT(store.Commit(write), IsOk());
}

std::vector<int64_t> Sequences(const std::vector<v1::JobEvent>& events) {
  std::vector<int64_t> sequences;
  for (const v1::JobEvent& event : events) sequences.push_back(event.sequence());
  return sequences;
}

std::vector<std::string> JobIds(const std::vector<v1::Job>& jobs) {
  std::vector<std::string> ids;
  for (const v1::Job& job : jobs) ids.push_back(job.job_id());
  return ids;
}

TEST(StoreTest, EventSequencesAreGapFreePerJob) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);

  JobWrite first;
  first.job_id = "job-a";
  first.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 100);
  first.events = {StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING),
                  StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED)};
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(first);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(1, 2));
  for (const v1::JobEvent& event : *stored) {
    EXPECT_EQ(event.job_id(), "job-a");
    EXPECT_GT(event.time().seconds(), 0) << "time is set when unset";
  }

  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 101), 1);

  JobWrite second;
  second.job_id = "job-a";  // No job upsert: events of an existing job.
  v1::JobEvent timed = StateEvent(v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING);
  timed.mutable_time()->set_seconds(42);
  second.events = {timed, StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED),
                   StateEvent(v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_SUCCEEDED)};
  stored = store->Commit(second);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(3, 4, 5));
  EXPECT_EQ((*stored)[0].time().seconds(), 42) << "a set time is kept";

  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(5));
  EXPECT_THAT(store->LastEventSequence("job-b"), ::tessera::testing::IsOkAndHolds(1));
  EXPECT_THAT(store->LastEventSequence("job-none"), ::tessera::testing::IsOkAndHolds(0));

  absl::StatusOr<std::vector<v1::JobEvent>> all = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(Sequences(*all), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_EQ((*all)[2].state_change().new_state(), v1::JOB_STATE_RUNNING);
}

TEST(StoreTest, ReadEventsAfterSequenceWithLimit) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 10);

  absl::StatusOr<std::vector<v1::JobEvent>> after = store->ReadEvents("job-a", 7, 0);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(Sequences(*after), ElementsAre(8, 9, 10));

  after = store->ReadEvents("job-a", 2, 3);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(Sequences(*after), ElementsAre(3, 4, 5));

  after = store->ReadEvents("job-a", 10, 0);
  ASSERT_THAT(after, IsOk());
  EXPECT_THAT(*after, IsEmpty());
}

TEST(StoreTest, CommitRejectsBadWrites) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);

  JobWrite no_id;
  no_id.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 1);
  EXPECT_THAT(store->Commit(no_id),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));

  JobWrite mismatch;
  mismatch.job_id = "job-b";
  mismatch.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 1);
  EXPECT_THAT(store->Commit(mismatch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job-a")));

  JobWrite unknown;
  unknown.job_id = "job-missing";
  unknown.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING));
  EXPECT_THAT(store->Commit(unknown),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job 'job-missing' not found")));

  v1::JobEvent foreign = StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING);
  foreign.set_job_id("job-d");
  JobWrite foreign_event;
  foreign_event.job_id = "job-c";
  foreign_event.job = MakeJob("job-c", v1::JOB_STATE_PENDING, 1);
  foreign_event.events.push_back(foreign);
  EXPECT_THAT(store->Commit(foreign_event),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("events[0]")));
}

TEST(StoreTest, MetricPointsAreKeyedByStep) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
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

TEST(StoreTest, ListJobsPaginatesNewestFirst) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  // 25 jobs; jobs 20..24 share one create_time, so the job_id tie-break counts.
  std::vector<std::string> newest_first;
  for (int i = 0; i < 25; ++i) {
    const std::string id = absl::StrFormat("job-%08x", i);
    const v1::JobState state = i % 2 == 0 ? v1::JOB_STATE_RUNNING : v1::JOB_STATE_SUCCEEDED;
    SubmitJob(*store, MakeJob(id, state, i < 20 ? 1000 + i : 2000));
    newest_first.insert(newest_first.begin(), id);
  }

  std::vector<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<JobPage> page = store->ListJobs({}, 10, token);
    ASSERT_THAT(page, IsOk());
    ++pages;
    EXPECT_LE(page->jobs.size(), 10u);
    for (const std::string& id : JobIds(page->jobs)) seen.push_back(id);
    token = page->next_page_token;
    ASSERT_LE(pages, 3) << "the last page must return an empty token";
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(seen, newest_first);

  // Filtered: the 13 RUNNING jobs (even i), newest first, over two pages.
  absl::StatusOr<JobPage> running = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(running, IsOk());
  ASSERT_THAT(running->jobs, SizeIs(10));
  for (const v1::Job& job : running->jobs) EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  absl::StatusOr<JobPage> rest =
      store->ListJobs({v1::JOB_STATE_RUNNING}, 10, running->next_page_token);
  ASSERT_THAT(rest, IsOk());
  EXPECT_THAT(rest->jobs, SizeIs(3));
  EXPECT_EQ(rest->next_page_token, "");
  EXPECT_EQ(rest->jobs.back().job_id(), "job-00000000");

  absl::StatusOr<JobPage> both =
      store->ListJobs({v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED}, 0, "");
  ASSERT_THAT(both, IsOk());
  EXPECT_THAT(both->jobs, SizeIs(25));
  EXPECT_EQ(both->next_page_token, "");

  absl::StatusOr<JobPage> none = store->ListJobs({v1::JOB_STATE_CANCELLED}, 0, "");
  ASSERT_THAT(none, IsOk());
  EXPECT_THAT(none->jobs, IsEmpty());

  EXPECT_THAT(store->ListJobs({}, 10, "not a token!"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
  EXPECT_THAT(store->ListJobs({}, 10, "YWJj"),  // base64 of "abc"
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("page_token")));
}

TEST(StoreTest, ListActiveJobsOldestFirst) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-run", v1::JOB_STATE_RUNNING, 30));
  SubmitJob(*store, MakeJob("job-done", v1::JOB_STATE_SUCCEEDED, 5));
  SubmitJob(*store, MakeJob("job-pend", v1::JOB_STATE_PENDING, 10));
  SubmitJob(*store, MakeJob("job-fail", v1::JOB_STATE_FAILED, 15));
  SubmitJob(*store, MakeJob("job-restart", v1::JOB_STATE_RESTARTING, 20));
  SubmitJob(*store, MakeJob("job-sched", v1::JOB_STATE_SCHEDULED, 25));
  SubmitJob(*store, MakeJob("job-cancel", v1::JOB_STATE_CANCELLED, 1));

  absl::StatusOr<std::vector<v1::Job>> active = store->ListActiveJobs();
  ASSERT_THAT(active, IsOk());
  EXPECT_THAT(JobIds(*active), ElementsAre("job-pend", "job-restart", "job-sched", "job-run"));

  // A state change moves a job out of the active set.
  JobWrite finish;
  finish.job_id = "job-run";
  finish.job = MakeJob("job-run", v1::JOB_STATE_SUCCEEDED, 30);
  ASSERT_THAT(store->Commit(finish), IsOk());
  active = store->ListActiveJobs();
  ASSERT_THAT(active, IsOk());
  EXPECT_THAT(JobIds(*active), ElementsAre("job-pend", "job-restart", "job-sched"));
}

TEST(StoreTest, FindsJobByRequestId) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  JobWrite submit;
  submit.job_id = "job-a";
  submit.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 1);
  submit.request_id = "req-1";
  ASSERT_THAT(store->Commit(submit), IsOk());
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 2));  // No request id.

  absl::StatusOr<std::optional<v1::Job>> found = store->FindJobByRequestId("req-1");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->job_id(), "job-a");

  // A later upsert without a request id keeps the recorded one.
  JobWrite update;
  update.job_id = "job-a";
  update.job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 1);
  ASSERT_THAT(store->Commit(update), IsOk());
  found = store->FindJobByRequestId("req-1");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->state(), v1::JOB_STATE_RUNNING);

  found = store->FindJobByRequestId("req-2");
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());
  found = store->FindJobByRequestId("");
  ASSERT_THAT(found, IsOk());
  EXPECT_FALSE(found->has_value());

  JobWrite duplicate;
  duplicate.job_id = "job-c";
  duplicate.job = MakeJob("job-c", v1::JOB_STATE_PENDING, 3);
  duplicate.request_id = "req-1";
  EXPECT_THAT(store->Commit(duplicate),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-c")));
}

TEST(StoreTest, CheckpointsNewestFirstAndRetention) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
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
  retain.deleted_checkpoint_steps = {100, 200};
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

TEST(StoreTest, NodesUpsertListDelete) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  v1::Node node_b;
  node_b.set_node_id("node-b");
  node_b.set_state(v1::NODE_STATE_READY);
  v1::Node node_a;
  node_a.set_node_id("node-a");
  node_a.set_address("10.0.0.1:50052");
  ASSERT_THAT(store->PutNode(node_b), IsOk());
  ASSERT_THAT(store->PutNode(node_a), IsOk());
  node_b.set_state(v1::NODE_STATE_LOST);
  ASSERT_THAT(store->PutNode(node_b), IsOk());
  EXPECT_THAT(store->PutNode(v1::Node()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("node_id")));

  absl::StatusOr<std::vector<v1::Node>> nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  ASSERT_THAT(*nodes, SizeIs(2));
  EXPECT_EQ((*nodes)[0].node_id(), "node-a");
  EXPECT_EQ((*nodes)[0].address(), "10.0.0.1:50052");
  EXPECT_EQ((*nodes)[1].node_id(), "node-b");
  EXPECT_EQ((*nodes)[1].state(), v1::NODE_STATE_LOST);

  ASSERT_THAT(store->DeleteNode("node-a"), IsOk());
  ASSERT_THAT(store->DeleteNode("node-absent"), IsOk());
  nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  ASSERT_THAT(*nodes, SizeIs(1));
  EXPECT_EQ((*nodes)[0].node_id(), "node-b");
}

TEST(StoreTest, WriteObserverSeesEveryWrite) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  std::vector<StoreWriteStats> observed;
  store->SetWriteObserver([&](const StoreWriteStats& stats) { observed.push_back(stats); });
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 2);
  v1::Node node;
  node.set_node_id("node-a");
  ASSERT_THAT(store->PutNode(node), IsOk());
  ASSERT_THAT(store->DeleteNode("node-a"), IsOk());
  JobWrite rejected;
  rejected.job_id = "job-missing";
  rejected.metrics.push_back(Metrics(1, 1));
  EXPECT_FALSE(store->Commit(rejected).ok());
  ASSERT_THAT(observed, SizeIs(3)) << "failed writes are not observed";
  for (const StoreWriteStats& stats : observed) {
    EXPECT_GE(stats.seconds, 0);
    EXPECT_GE(stats.cpu_seconds, 0);
    EXPECT_EQ(stats.writes, 1);  // one at a time on this thread
  }
  // A transaction's CPU time is the leader's: some, and at most its wall time plus the clocks'
  // granularity.
  std::vector<JobWrite> writes(50);
  for (int i = 0; i < 50; ++i) {
    writes[i].job_id = absl::StrCat("job-many-", i);
    writes[i].job = MakeJob(writes[i].job_id, v1::JOB_STATE_PENDING, 100 + i);
  }
  for (const auto& result : store->CommitAll(writes)) EXPECT_THAT(result, IsOk());
  ASSERT_THAT(observed, SizeIs(4));
  EXPECT_EQ(observed.back().writes, 50);
  EXPECT_GT(observed.back().cpu_seconds, 0);
  EXPECT_LE(observed.back().cpu_seconds, observed.back().seconds + 0.01);
  store->SetWriteObserver(nullptr);
  ASSERT_THAT(store->PutNode(node), IsOk());
  EXPECT_THAT(observed, SizeIs(4));
}

TEST(StoreTest, NextJobIdIsUniqueAndMonotonicAcrossReopen) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::vector<std::string> ids;
  for (int round = 0; round < 3; ++round) {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 5; ++i) {
      absl::StatusOr<std::string> id = store->NextJobId();
      ASSERT_THAT(id, IsOk());
      EXPECT_THAT(*id, ::testing::MatchesRegex("job-[0-9a-f]{8}"));
      ids.push_back(*id);
    }
  }
  EXPECT_EQ(ids.front(), "job-00000001");
  EXPECT_EQ(ids.back(), "job-0000000f");
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_LT(ids[i - 1], ids[i]);
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), ids.size());

  // An id already used by a stored job is skipped.
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-00000010", v1::JOB_STATE_PENDING, 1));
  EXPECT_THAT(store->NextJobId(), ::tessera::testing::IsOkAndHolds("job-00000011"));
}

TEST(StoreTest, CommitNewJobAllocatesTheIdInItsOwnTransaction) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  auto new_job = [](const std::string& request_id) {
    JobWrite write;
    write.job = MakeJob("", v1::JOB_STATE_PENDING, 1);
    write.request_id = request_id;
    write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
    return write;
  };
  JobWrite first = new_job("req-1");
  ASSERT_THAT(store->CommitNewJob(&first), IsOk());
  EXPECT_EQ(first.job_id, "job-00000001");
  EXPECT_EQ(first.job->job_id(), "job-00000001");
  absl::StatusOr<v1::Job> stored = store->GetJob("job-00000001");
  ASSERT_THAT(stored, IsOk());
  EXPECT_EQ(stored->job_id(), "job-00000001");
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-00000001", 0, 0);
  ASSERT_THAT(events, IsOk());
  ASSERT_THAT(*events, SizeIs(1));
  EXPECT_EQ((*events)[0].job_id(), "job-00000001");
  EXPECT_THAT(
      store->FindJobByRequestId("req-1"),
      IsOkAndHolds(::testing::Optional(::testing::Property(&v1::Job::job_id, "job-00000001"))));

  // Shares the counter with NextJobId.
  EXPECT_THAT(store->NextJobId(), IsOkAndHolds("job-00000002"));
  // A write that fails (a request id already taken) consumes no id and leaves the write unnamed.
  JobWrite duplicate = new_job("req-1");
  EXPECT_THAT(store->CommitNewJob(&duplicate),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-00000003")));
  EXPECT_EQ(duplicate.job_id, "");
  EXPECT_EQ(duplicate.job->job_id(), "");
  EXPECT_THAT(store->GetJob("job-00000003"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-00000003")));
  JobWrite next = new_job("");
  ASSERT_THAT(store->CommitNewJob(&next), IsOk());
  EXPECT_EQ(next.job_id, "job-00000003");

  // A write that names a job, or has none, is refused before anything is stored.
  JobWrite named = new_job("");
  named.job_id = "job-x";
  EXPECT_THAT(store->CommitNewJob(&named),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  JobWrite named_event = new_job("");
  named_event.events[0].set_job_id("job-x");
  EXPECT_THAT(store->CommitNewJob(&named_event),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));
  JobWrite no_job;
  EXPECT_THAT(store->CommitNewJob(&no_job),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("job_id")));

  // The counter is durable: a reopened store goes on from it.
  store.reset();
  store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  JobWrite after_reopen = new_job("");
  ASSERT_THAT(store->CommitNewJob(&after_reopen), IsOk());
  EXPECT_EQ(after_reopen.job_id, "job-00000004");
}

TEST(StoreTest, ReopenKeepsData) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 7), 3);
    v1::Node node;
    node.set_node_id("node-a");
    ASSERT_THAT(store->PutNode(node), IsOk());
  }
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<v1::Job> job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->create_time().seconds(), 7);
  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(3));
  absl::StatusOr<std::vector<v1::Node>> nodes = store->ListNodes();
  ASSERT_THAT(nodes, IsOk());
  EXPECT_THAT(*nodes, SizeIs(1));
  // Sequences continue after a reopen.
  JobWrite more;
  more.job_id = "job-a";
  more.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED));
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(more);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(4));
}

// Reads use a connection of their own: while a commit waits for the database (here another
// connection holds its write lock, as a slow fsync would hold the store), reads answer at once
// with the last committed state, and a write's effect is visible to the next read.
TEST(StoreTest, ReadsDoNotWaitForACommitInProgress) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 1);
  ASSERT_THAT(store->GetJob("job-a"), IsOk());  // read-your-write

  sqlite3* other = nullptr;
  ASSERT_EQ(sqlite3_open_v2(path.c_str(), &other, SQLITE_OPEN_READWRITE, nullptr), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(other, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  absl::Notification committed;
  absl::Status commit_status;
  std::thread writer([&] {
    JobWrite write;
    write.job_id = "job-a";
    write.job = MakeJob("job-a", v1::JOB_STATE_SCHEDULED, 1);
    write.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
    commit_status = store->Commit(write).status();
    committed.Notify();
  });
  absl::SleepFor(absl::Milliseconds(200));  // the commit now waits for the lock, holding the store
  EXPECT_FALSE(committed.HasBeenNotified());

  const absl::Time start = absl::Now();
  absl::StatusOr<v1::Job> job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(store->ListWaitingJobs(), IsOkAndHolds(SizeIs(1)));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(1)));
  // The commit waits up to Store::kBusyTimeoutMs (5 s); the reads must not.
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_FALSE(committed.HasBeenNotified());

  ASSERT_EQ(sqlite3_exec(other, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(other);
  writer.join();
  ASSERT_THAT(commit_status, IsOk());
  job = store->GetJob("job-a");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(store->ListWaitingJobs(), IsOkAndHolds(IsEmpty()));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(2)));
}

// The child commits and kills itself with SIGKILL as soon as Commit returns:
// no destructor, no close, no checkpoint of the WAL. The parent must find
// everything the commit wrote.
TEST(StoreTest, CommitSurvivesSigkill) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);  // Creates the schema.
    ASSERT_NE(store, nullptr);
  }
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
    if (!store.ok()) _exit(10);
    JobWrite write;
    write.job_id = "job-kill";
    write.job = MakeJob("job-kill", v1::JOB_STATE_RUNNING, 9);
    for (int i = 0; i < 3; ++i) {
      write.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING));
    }
    write.metrics.push_back(Metrics(12, 2.5));
    v1::Checkpoint checkpoint;
    checkpoint.set_step(10);
    write.checkpoints.push_back(checkpoint);
    if (!(*store)->Commit(write).ok()) _exit(11);
    raise(SIGKILL);
    _exit(12);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(pid, &wait_status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(wait_status))
      << "child exited with " << (WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1);
  ASSERT_EQ(WTERMSIG(wait_status), SIGKILL);

  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<v1::Job> job = store->GetJob("job-kill");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-kill", 0, 0);
  ASSERT_THAT(events, IsOk());
  EXPECT_THAT(Sequences(*events), ElementsAre(1, 2, 3));
  absl::StatusOr<std::vector<v1::StepMetrics>> metrics = store->ReadMetrics("job-kill", 0, 0);
  ASSERT_THAT(metrics, IsOk());
  ASSERT_THAT(*metrics, SizeIs(1));
  EXPECT_DOUBLE_EQ(metrics->front().loss(), 2.5);
  absl::StatusOr<std::vector<v1::Checkpoint>> checkpoints = store->ListCheckpoints("job-kill");
  ASSERT_THAT(checkpoints, IsOk());
  EXPECT_THAT(*checkpoints, SizeIs(1));
}

TEST(StoreTest, OpeningANonDatabaseFileFails) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/not-a-db";
  {
    std::ofstream file(path);
    for (int i = 0; i < 100; ++i) file << "this is a text file, not a SQLite database\n";
  }
  EXPECT_THAT(Store::Open(path), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(path)));
  EXPECT_THAT(Store::Open(dir.path() + "/missing-dir/x.db"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("missing-dir")));
}

// Runs `sql` on the database file behind the store's back.
void RawExec(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* error = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql, nullptr, nullptr, &error), SQLITE_OK)
      << (error != nullptr ? error : "");
  sqlite3_free(error);
  sqlite3_close(db);
}

// The first column of the first row `sql` returns, read behind the store's back ("" for none).
std::string RawQuery(const std::string& path, const char* sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* stmt = nullptr;
  std::string value;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql, -1, &stmt, nullptr), SQLITE_OK) << sqlite3_errmsg(db);
  if (sqlite3_step(stmt) == SQLITE_ROW && sqlite3_column_text(stmt, 0) != nullptr) {
    value = reinterpret_cast<const char*>(sqlite3_column_text(stmt, 0));
  }
  sqlite3_finalize(stmt);
  sqlite3_close(db);
  return value;
}

// Updates write only the columns that may change, except when a write changes what they left
// alone: a new create_time reorders the job, a request id given later is recorded.
TEST(StoreTest, UpdatesKeepTheIndexedColumnsInStep) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  JobWrite submit;
  submit.job_id = "job-a";
  submit.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 10);
  submit.request_id = "req-a";
  ASSERT_THAT(store->Commit(submit), IsOk());
  SubmitJob(*store, MakeJob("job-b", v1::JOB_STATE_PENDING, 20));

  JobWrite later;  // A create_time moved past job-b's.
  later.job_id = "job-a";
  later.job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 30);
  ASSERT_THAT(store->Commit(later), IsOk());
  absl::StatusOr<JobPage> page = store->ListJobs({}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-a", "job-b"));
  page = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-a"));
  absl::StatusOr<std::optional<v1::Job>> found = store->FindJobByRequestId("req-a");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->create_time().seconds(), 30);

  JobWrite keyed;  // A request id recorded by an update, with the create_time unchanged.
  keyed.job_id = "job-b";
  keyed.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  keyed.request_id = "req-b";
  ASSERT_THAT(store->Commit(keyed), IsOk());
  found = store->FindJobByRequestId("req-b");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->state(), v1::JOB_STATE_SCHEDULED);
  page = store->ListJobs({v1::JOB_STATE_PENDING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(page->jobs, IsEmpty());

  // The same state again: the job's other fields change, its create_time only with a full
  // update.
  JobWrite same;
  same.job_id = "job-b";
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  same.job->mutable_spec()->set_name("renamed");
  ASSERT_THAT(store->Commit(same), IsOk());
  absl::StatusOr<v1::Job> job = store->GetJob("job-b");
  ASSERT_THAT(job, IsOk());
  EXPECT_EQ(job->spec().name(), "renamed");
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 35);
  ASSERT_THAT(store->Commit(same), IsOk());
  page = store->ListJobs({}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-b", "job-a"));
  page = store->ListJobs({v1::JOB_STATE_SCHEDULED}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-b"));
  same.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 20);
  ASSERT_THAT(store->Commit(same), IsOk());

  keyed.request_id = "req-a";  // Taken by job-a, on both update paths.
  EXPECT_THAT(store->Commit(keyed), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-b")));
  keyed.job = MakeJob("job-b", v1::JOB_STATE_SCHEDULED, 40);
  EXPECT_THAT(store->Commit(keyed), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("job-b")));
  found = store->FindJobByRequestId("req-b");
  ASSERT_THAT(found, IsOk());
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->create_time().seconds(), 20);
}

// A database written by schema version 1 (jobs in a WITHOUT ROWID table, a row per event) is
// migrated on open, through version 3 (a write's events in one row):
// every job, event, metric point and checkpoint survives (dropping the old jobs table must not
// cascade into the others), and foreign keys are on again afterwards.
TEST(StoreTest, MigratesAVersion1Database) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) {
      JobWrite write;
      write.job_id = absl::StrCat("job-", i);
      write.job = MakeJob(write.job_id, v1::JOB_STATE_RUNNING, 100 + i);
      write.request_id = absl::StrCat("req-", i);
      // One event a write: before version 3 every event had a row of its own.
      write.events = {StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING)};
      write.metrics = {Metrics(5, 1.5), Metrics(6, 1.25)};
      v1::Checkpoint checkpoint;
      checkpoint.set_step(6);
      write.checkpoints.push_back(checkpoint);
      ASSERT_THAT(store->Commit(write), IsOk());
      JobWrite second;
      second.job_id = write.job_id;
      second.events = {StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING)};
      ASSERT_THAT(store->Commit(second), IsOk());
    }
  }
  // Back to version 1's layout, as a version 1 binary left it.
  RawExec(path, R"sql(
PRAGMA foreign_keys = OFF;
BEGIN;
CREATE TABLE jobs_v1 (
  job_id TEXT PRIMARY KEY NOT NULL,
  state INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  create_time_ns INTEGER NOT NULL,
  request_id TEXT UNIQUE,
  job BLOB NOT NULL
) WITHOUT ROWID;
INSERT INTO jobs_v1 SELECT job_id, state, priority, create_time_ns, request_id, job FROM jobs;
DROP TABLE jobs;
ALTER TABLE jobs_v1 RENAME TO jobs;
CREATE INDEX jobs_by_create_time ON jobs (create_time_ns, job_id);
CREATE INDEX jobs_by_state ON jobs (state, create_time_ns, job_id);
ALTER TABLE job_events DROP COLUMN last_sequence;
UPDATE schema_version SET version = 1;
COMMIT;
)sql");
  ASSERT_EQ(RawQuery(path, "SELECT count(*) FROM pragma_table_info('job_events')"), "3");
  ASSERT_THAT(RawQuery(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
              HasSubstr("WITHOUT ROWID"));

  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(RawQuery(path, "SELECT version FROM schema_version"),
            std::to_string(Store::kSchemaVersion));
  EXPECT_THAT(RawQuery(path, "SELECT sql FROM sqlite_master WHERE name = 'jobs'"),
              ::testing::Not(HasSubstr("WITHOUT ROWID")));
  EXPECT_EQ(RawQuery(path, "SELECT \"table\" FROM pragma_foreign_key_list('job_events')"), "jobs");
  EXPECT_EQ(RawQuery(path, "SELECT count(*) FROM pragma_index_list('jobs')"), "4");
  for (int i = 0; i < 3; ++i) {
    const std::string job_id = absl::StrCat("job-", i);
    absl::StatusOr<std::optional<v1::Job>> found =
        store->FindJobByRequestId(absl::StrCat("req-", i));
    ASSERT_THAT(found, IsOk());
    ASSERT_TRUE(found->has_value());
    EXPECT_EQ((*found)->job_id(), job_id);
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents(job_id, 0, 0);
    ASSERT_THAT(events, IsOk());
    EXPECT_THAT(Sequences(*events), ElementsAre(1, 2));
    EXPECT_THAT(store->ReadMetrics(job_id, 0, 0), IsOkAndHolds(SizeIs(2)));
    EXPECT_THAT(store->ListCheckpoints(job_id), IsOkAndHolds(SizeIs(1)));
  }
  absl::StatusOr<JobPage> page = store->ListJobs({v1::JOB_STATE_RUNNING}, 10, "");
  ASSERT_THAT(page, IsOk());
  EXPECT_THAT(JobIds(page->jobs), ElementsAre("job-2", "job-1", "job-0"));

  // Writing goes on where it stopped.
  JobWrite next;
  next.job_id = "job-1";
  next.job = MakeJob("job-1", v1::JOB_STATE_SUCCEEDED, 101);
  next.events = {StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED)};
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(next);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(3));
  EXPECT_THAT(store->ListActiveJobs(), IsOkAndHolds(SizeIs(2)));
}

TEST(StoreTest, NewerSchemaIsRefused) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  ASSERT_NE(OpenOrDie(path), nullptr);
  RawExec(path, "UPDATE schema_version SET version = 99");
  EXPECT_THAT(Store::Open(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("schema version 99")));
}

// A write that fails half-way (here a trigger rejects its metric point)
// leaves nothing behind: the job row and events written before it roll back.
TEST(StoreTest, FailedCommitRollsBackEverything) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  ASSERT_NE(OpenOrDie(path), nullptr);
  RawExec(path,
          "CREATE TRIGGER reject_negative_step BEFORE INSERT ON step_metrics "
          "WHEN NEW.step < 0 BEGIN SELECT RAISE(ABORT, 'negative step'); END;");
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  JobWrite write;
  write.job_id = "job-a";
  write.job = MakeJob("job-a", v1::JOB_STATE_PENDING, 1);
  write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
  write.metrics.push_back(Metrics(-1, 1));
  EXPECT_THAT(store->Commit(write), StatusIs(absl::StatusCode::kInternal,
                                             HasSubstr("step metrics for job-a: negative step")));
  EXPECT_THAT(store->GetJob("job-a"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-a")));
  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(0));
  // The store is usable afterwards, and sequences start from 1.
  write.metrics[0].set_step(1);
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(write);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(1));
}

// A write's events share one row (schema v3); reads give them one by one, from any point of a
// row, next to rows of one event.
TEST(StoreTest, AWritesEventsShareARowAndReadBackOneByOne) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 1);  // event 1, alone
  JobWrite report;
  report.job_id = "job-a";
  for (int step = 1; step <= 10; ++step) {
    *report.events.emplace_back().mutable_metrics() = Metrics(step, 10.0 / step);
  }
  ASSERT_THAT(store->Commit(report), IsOkAndHolds(SizeIs(10)));  // events 2-11, one row
  JobWrite single;
  single.job_id = "job-a";
  single.events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
  absl::StatusOr<std::vector<v1::JobEvent>> stored = store->Commit(single);
  ASSERT_THAT(stored, IsOk());
  EXPECT_THAT(Sequences(*stored), ElementsAre(12));
  EXPECT_THAT(store->LastEventSequence("job-a"), IsOkAndHolds(12));

  absl::StatusOr<std::vector<v1::JobEvent>> all = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(all, IsOk());
  EXPECT_THAT(Sequences(*all), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12));
  for (int i = 1; i <= 10; ++i) {
    EXPECT_EQ((*all)[i].metrics().step(), i);
    EXPECT_EQ((*all)[i].job_id(), "job-a");
  }
  EXPECT_EQ((*all)[11].state_change().new_state(), v1::JOB_STATE_SCHEDULED);
  auto read = [&](int64_t after, int limit) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", after, limit);
    EXPECT_THAT(events, IsOk());
    return events.ok() ? Sequences(*events) : std::vector<int64_t>{-1};
  };
  EXPECT_THAT(read(3, 4), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(read(1, 1), ElementsAre(2));
  EXPECT_THAT(read(10, 0), ElementsAre(11, 12));
  EXPECT_THAT(read(11, 0), ElementsAre(12));
  EXPECT_THAT(read(12, 0), IsEmpty());
  // Three rows hold the twelve events.
  store.reset();
  EXPECT_EQ(RawQuery(path, "SELECT COUNT(*) FROM job_events"), "3");
}

TEST(StoreTest, CorruptBlobIsDataLoss) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1), 1);
    JobWrite write;
    write.job_id = "job-a";
    write.metrics.push_back(Metrics(1, 1));
    // Events 2 and 3 in one row.
    *write.events.emplace_back().mutable_metrics() = Metrics(1, 1);
    write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
    ASSERT_THAT(store->Commit(write), IsOk());
  }
  // 0xff is a field header with wire type 7, which no protobuf parser accepts.
  RawExec(path,
          "UPDATE jobs SET job = x'ffffffff'; UPDATE job_events SET event = x'ffffffff';"
          "UPDATE step_metrics SET metrics = x'ffffffff';");
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  EXPECT_THAT(store->GetJob("job-a"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job 'job-a' in table jobs")));
  EXPECT_THAT(store->ListJobs({}, 0, ""),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job-a")));
  EXPECT_THAT(store->ListActiveJobs(), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job-a")));
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job_events")));
  EXPECT_THAT(store->ReadEvents("job-a", 1, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("events 2 to 3")));
  EXPECT_THAT(store->ReadMetrics("job-a", 0, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("step_metrics")));
}

TEST(StoreTest, ConcurrentCommitsKeepSequencesGapFree) {
  std::unique_ptr<Store> store = OpenOrDie(":memory:");
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  constexpr int kThreads = 4;
  constexpr int kCommitsPerThread = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCommitsPerThread; ++i) {
        JobWrite write;
        write.job_id = "job-a";
        write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
        write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
        EXPECT_THAT(store->Commit(write), IsOk());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", 0, 0);
  ASSERT_THAT(events, IsOk());
  ASSERT_THAT(*events, SizeIs(2 * kThreads * kCommitsPerThread));
  for (size_t i = 0; i < events->size(); ++i) EXPECT_EQ((*events)[i].sequence(), int64_t(i) + 1);
}

// Reads on many threads share the pool of read-only connections while commits go on. Whichever
// connection a read gets, it sees every commit that returned before it began: a thread never
// sees a job go back, and the events read after the job hold at least the job's.
TEST(StoreTest, ReadsOnManyThreadsNeverSeeAnOlderState) {
  tessera::testing::ScopedTempDir dir("store");
  std::unique_ptr<Store> store = OpenOrDie(dir.path() + "/coordinator.db");
  ASSERT_NE(store, nullptr);
  v1::Job job = MakeJob("job-a", v1::JOB_STATE_RUNNING, 1);
  SubmitJob(*store, job, /*events=*/1);
  constexpr int kCommits = 150;
  constexpr int kReaders = 6;
  std::atomic<bool> done = false;
  std::vector<std::thread> readers;
  std::atomic<int> reads = 0;
  for (int t = 0; t < kReaders; ++t) {
    readers.emplace_back([&] {
      int64_t last_step = -1;
      while (!done.load()) {
        absl::StatusOr<v1::Job> read = store->GetJob("job-a");
        ASSERT_THAT(read, IsOk());
        EXPECT_GE(read->current_step(), last_step);
        last_step = read->current_step();
        absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents("job-a", 0, 0);
        ASSERT_THAT(events, IsOk());
        // One event from the submit, one per commit.
        EXPECT_GE(static_cast<int64_t>(events->size()), last_step + 1);
        reads.fetch_add(1);
      }
    });
  }
  for (int i = 1; i <= kCommits; ++i) {
    job.set_current_step(i);
    JobWrite write;
    write.job_id = "job-a";
    write.job = job;
    write.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
    ASSERT_THAT(store->Commit(write), IsOk());
    // Every read that begins now must see step i.
    absl::StatusOr<v1::Job> read = store->GetJob("job-a");
    ASSERT_THAT(read, IsOk());
    EXPECT_EQ(read->current_step(), i);
  }
  done = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_GT(reads.load(), kReaders);
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(kCommits + 1)));
}

TEST(StoreTest, CommitAllStoresEachWriteAtomicallyInOneTransaction) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_PENDING, 1), 1);
    int transactions = 0;
    store->SetWriteObserver([&](const StoreWriteStats&) { ++transactions; });
    std::vector<JobWrite> writes(3);
    writes[0].job_id = "job-a";
    writes[0].job = MakeJob("job-a", v1::JOB_STATE_SCHEDULED, 1);
    writes[0].events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
    // Fails half-way (the job row is not there): its event must not be stored either.
    writes[1].job_id = "job-missing";
    writes[1].events.push_back(StateEvent(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED));
    writes[2].job_id = "job-b";
    writes[2].job = MakeJob("job-b", v1::JOB_STATE_PENDING, 2);
    writes[2].events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
    std::vector<absl::StatusOr<std::vector<v1::JobEvent>>> results = store->CommitAll(writes);
    ASSERT_THAT(results, SizeIs(3));
    ASSERT_THAT(results[0], IsOk());
    EXPECT_THAT(Sequences(*results[0]), ElementsAre(2));
    EXPECT_EQ(results[1].status().code(), absl::StatusCode::kNotFound);
    ASSERT_THAT(results[2], IsOk());
    EXPECT_THAT(Sequences(*results[2]), ElementsAre(1));
    EXPECT_EQ(transactions, 1);
    // Alone, the failing write fails the same way and commits nothing.
    EXPECT_EQ(store->Commit(writes[1]).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(transactions, 1);
    store->SetWriteObserver(nullptr);
  }
  // What CommitAll returned is on disk.
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  absl::StatusOr<v1::Job> a = store->GetJob("job-a");
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(store->ReadEvents("job-a", 0, 0), IsOkAndHolds(SizeIs(2)));
  EXPECT_THAT(store->GetJob("job-b"), IsOk());
  EXPECT_EQ(store->GetJob("job-missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(store->ReadEvents("job-missing", 0, 0), IsOkAndHolds(SizeIs(0)));
}

TEST(StoreTest, ConcurrentWritersShareCommitsAndEveryWriteIsDurable) {
  tessera::testing::ScopedTempDir dir("store");
  const std::string path = dir.path() + "/coordinator.db";
  constexpr int kThreads = 8;
  constexpr int kWritesPerThread = 25;
  std::set<std::string> ids;
  {
    std::unique_ptr<Store> store = OpenOrDie(path);
    ASSERT_NE(store, nullptr);
    absl::Mutex mu;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kWritesPerThread; ++i) {
          // A job id and the job's first write, as a submission makes them, and a node record.
          absl::StatusOr<std::string> id = store->NextJobId();
          ASSERT_THAT(id, IsOk());
          {
            absl::MutexLock lock(&mu);
            ids.insert(*id);
          }
          JobWrite write;
          write.job_id = *id;
          write.job = MakeJob(*id, v1::JOB_STATE_PENDING, t * 1000 + i);
          write.events.push_back(StateEvent(v1::JOB_STATE_UNSPECIFIED, v1::JOB_STATE_PENDING));
          EXPECT_THAT(store->Commit(write), IsOk());
          v1::Node node;
          node.set_node_id(absl::StrCat("node-", t));
          EXPECT_THAT(store->PutNode(node), IsOk());
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  ASSERT_THAT(ids, SizeIs(kThreads * kWritesPerThread)) << "job ids are unique";
  std::unique_ptr<Store> store = OpenOrDie(path);
  ASSERT_NE(store, nullptr);
  for (const std::string& id : ids) {
    EXPECT_THAT(store->GetJob(id), IsOk()) << id;
    EXPECT_THAT(store->ReadEvents(id, 0, 0), IsOkAndHolds(SizeIs(1))) << id;
  }
  EXPECT_THAT(store->ListNodes(), IsOkAndHolds(SizeIs(kThreads)));
  EXPECT_THAT(store->NextJobId(),
              IsOkAndHolds(absl::StrFormat("job-%08x", kThreads * kWritesPerThread + 1)));
}

// Each Commit is a durable transaction (an fsync of the WAL); prints the rate.
TEST(StoreTest, ThousandEventCommitLoop) {
  tessera::testing::ScopedTempDir dir("store");
  std::unique_ptr<Store> store = OpenOrDie(dir.path() + "/coordinator.db");
  ASSERT_NE(store, nullptr);
  SubmitJob(*store, MakeJob("job-a", v1::JOB_STATE_RUNNING, 1));
  constexpr int kCommits = 1000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= kCommits; ++i) {
    JobWrite write;
    write.job_id = "job-a";
    v1::JobEvent event;
    *event.mutable_metrics() = Metrics(i, 1.0 / i);
    write.events.push_back(event);
    write.metrics.push_back(event.metrics());
    ASSERT_THAT(store->Commit(write), IsOk());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << absl::StrFormat("[ store    ] %d single-event commits in %.3f s: %.0f commits/s\n",
                               kCommits, seconds, kCommits / seconds);
  EXPECT_THAT(store->LastEventSequence("job-a"), ::tessera::testing::IsOkAndHolds(kCommits));
  absl::StatusOr<std::vector<v1::StepMetrics>> metrics = store->ReadMetrics("job-a", 0, 0);
  ASSERT_THAT(metrics, IsOk());
  EXPECT_THAT(*metrics, SizeIs(kCommits));
}

}  // namespace
}  // namespace tessera::coordinator
