// Writing to the Store (store.cc, the engines' group commit): the checks on a write, a failed
// write rolled back whole, the group commit (CommitAll, concurrent writers, the write observer,
// events and metric points exactly once) and durability (a commit survives SIGKILL; the
// single-commit rate). Most run on SQLite and on PostgreSQL (StoreBackendTest).
//
// Thread safety: each test owns its store; the threads a test starts use it as the
// coordinator's threads do.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/status_matchers.h"
#include "coordinator/store/store.h"
#include "coordinator/store/store_fixture.h"
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
using ::testing::SizeIs;

TEST_P(StoreBackendTest, CommitRejectsBadWrites) {
  std::unique_ptr<Store> store = OpenOrDie(location());
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

TEST_P(StoreBackendTest, WriteObserverSeesEveryWrite) {
  std::unique_ptr<Store> store = OpenOrDie(location());
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

TEST_P(StoreBackendTest, CommitAllStoresEachWriteAtomicallyInOneTransaction) {
  const std::string& path = location();
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

TEST_P(StoreBackendTest, ConcurrentWritersShareCommitsAndEveryWriteIsDurable) {
  const std::string& path = location();
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

// Reporters of several jobs and a shared one commit events and metric points at once, so that
// their writes share group commits, and each resends some steps (a relayed batch sent again):
// every event is stored once with gap-free sequences, and every step has one point, the last
// sent.
TEST_P(StoreBackendTest, ConcurrentGroupCommitsStoreEventsAndMetricPointsExactlyOnce) {
  std::unique_ptr<Store> store = OpenOrDie(location());
  ASSERT_NE(store, nullptr);
  constexpr int kThreads = 6;
  constexpr int kSteps = 30;
  for (int t = 0; t < kThreads; ++t) {
    SubmitJob(*store, MakeJob(absl::StrCat("job-", t), v1::JOB_STATE_RUNNING, t));
  }
  SubmitJob(*store, MakeJob("job-shared", v1::JOB_STATE_RUNNING, 100));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string job_id = absl::StrCat("job-", t);
      for (int step = 1; step <= kSteps; ++step) {
        JobWrite own;
        own.job_id = job_id;
        own.metrics.push_back(Metrics(step, t + 1.0 / step));
        // Every third step is resent, with the same point.
        if (step % 3 == 0) own.metrics.push_back(Metrics(step - 1, t + 1.0 / (step - 1)));
        *own.events.emplace_back().mutable_metrics() = own.metrics.front();
        JobWrite shared;
        shared.job_id = "job-shared";
        shared.events.push_back(StateEvent(v1::JOB_STATE_RUNNING, v1::JOB_STATE_RUNNING));
        for (const auto& result : store->CommitAll({own, shared})) EXPECT_THAT(result, IsOk());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    const std::string job_id = absl::StrCat("job-", t);
    absl::StatusOr<std::vector<v1::StepMetrics>> metrics = store->ReadMetrics(job_id, 0, 0);
    ASSERT_THAT(metrics, IsOk());
    ASSERT_THAT(*metrics, SizeIs(kSteps)) << job_id;
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ((*metrics)[i].step(), i + 1);
      EXPECT_DOUBLE_EQ((*metrics)[i].loss(), t + 1.0 / (i + 1));
    }
    absl::StatusOr<std::vector<v1::JobEvent>> events = store->ReadEvents(job_id, 0, 0);
    ASSERT_THAT(events, IsOk());
    ASSERT_THAT(*events, SizeIs(kSteps));
    for (int i = 0; i < kSteps; ++i) {
      EXPECT_EQ((*events)[i].sequence(), i + 1);
      EXPECT_EQ((*events)[i].metrics().step(), i + 1) << "in commit order";
    }
  }
  absl::StatusOr<std::vector<v1::JobEvent>> shared = store->ReadEvents("job-shared", 0, 0);
  ASSERT_THAT(shared, IsOk());
  ASSERT_THAT(*shared, SizeIs(kThreads * kSteps));
  for (size_t i = 0; i < shared->size(); ++i) EXPECT_EQ((*shared)[i].sequence(), int64_t(i) + 1);
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

// Each Commit is a durable transaction (an fsync of the WAL); prints the rate.
TEST_P(StoreBackendTest, ThousandEventCommitLoop) {
  std::unique_ptr<Store> store = OpenOrDie(location());
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

INSTANTIATE_TEST_SUITE_P(Backends, StoreBackendTest, kStoreBackends, StoreBackendName);

}  // namespace
}  // namespace tessera::coordinator
