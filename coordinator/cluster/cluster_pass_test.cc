// In-process tests of Cluster's scheduling passes: placements held back until stored and taken
// back when they cannot be, the loop (Start) storing a pass beside the next one, announcements
// to the nodes, master ports across a restart, and the rule that no store write is made under
// the cluster lock. The fixture is in cluster_fixture.h.

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_matchers.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/cluster/cluster_fixture.h"
#include "coordinator/jobs/attempt_policy.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

// While a pass stores a placement, its assignments are held back: a heartbeat from one of its
// nodes is answered at once without them (it never waits for the store), and the node gets them
// with its first heartbeat after the store, the notifier telling it then, not before.
TEST_F(ClusterTest, APlacementsAssignmentsLeaveOnlyOnceStoredAndNoHeartbeatWaits) {
  Register("n1", 2);
  Register("n2", 2);
  AssignmentNotifier notifier;
  cluster_->SetAssignmentNotifier(&notifier);
  std::atomic<int> notices{0};
  const AssignmentNotifier::Handle watch1 = notifier.Subscribe("n1", [&] { ++notices; });
  const AssignmentNotifier::Handle watch2 = notifier.Subscribe("n2", [&] { ++notices; });
  const std::string job_id = Submit(CpuSpec(2, 0));
  absl::Notification storing, release;
  BlockFirstWriteOf(job_id, storing, release);
  std::thread pass([&] { cluster_->Tick(); });
  ASSERT_TRUE(storing.WaitForNotificationWithTimeout(absl::Seconds(30)));

  // Both nodes' heartbeats return while the store is blocked, with no assignment.
  for (const char* node : {"n1", "n2"}) {
    v1::HeartbeatRequest beat;
    beat.set_node_id(node);
    absl::StatusOr<v1::HeartbeatResponse> response = cluster_->Heartbeat(beat);
    ASSERT_THAT(response.status(), IsOk()) << node;
    EXPECT_EQ(response->start_size(), 0) << node;
  }
  // The notifier calls back on its own thread: every notice given so far has been delivered once
  // it flushed.
  Flush(notifier);
  EXPECT_EQ(notices.load(), 0) << "no node is told of an assignment that is not stored";

  release.Notify();
  pass.join();
  store_->SetWriteFailureInjector(nullptr);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  // The gang went to one node (two slots); which one is the packing rule's business. That node
  // is told, and its next heartbeat carries the assignment.
  Flush(notifier);
  EXPECT_EQ(notices.load(), 1);
  notifier.Unsubscribe(watch1);
  notifier.Unsubscribe(watch2);
  cluster_->SetAssignmentNotifier(nullptr);
  int starts = 0;
  for (const char* node : {"n1", "n2"}) {
    v1::HeartbeatRequest beat;
    beat.set_node_id(node);
    absl::StatusOr<v1::HeartbeatResponse> response = cluster_->Heartbeat(beat);
    ASSERT_THAT(response.status(), IsOk()) << node;
    for (const auto& start : response->start()) {
      EXPECT_EQ(start.trainers(0).job_id(), job_id);
      ++starts;
    }
  }
  EXPECT_EQ(starts, 1);
}

// Under Start(), a pass's placements are stored on the store thread while the next pass runs:
// with the first placement's transaction blocked, a later pass still admits another job, neither
// placement reaches a node before it is stored, the first is not placed twice or drained while
// its job still reads PENDING, and both are stored once the transaction goes on.
TEST_F(ClusterTest, TheLoopStoresAPassBesideTheNextPass) {
  UseFileStoreAndFastLoop();
  Register("n1", 2);
  Register("n2", 2);
  const std::string first = Submit(CpuSpec(2, 0));
  absl::Notification storing, release;
  BlockFirstWriteOf(first, storing, release);
  std::atomic<double> overlapped{0};
  StartLoop([&](const ClusterStats& stats, double) {
    if (auto it = stats.phase_seconds.find("store_overlapped"); it != stats.phase_seconds.end()) {
      overlapped = overlapped + it->second;
    }
  });
  cluster_->RequestPass();  // the loop's time is the simulated clock's, which waits here
  ASSERT_TRUE(storing.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // Passes go on while the first placement is being stored; its job still reads PENDING, and it
  // holds the devices of one node.
  EXPECT_TRUE(AwaitPasses(Passes() + 3)) << "the passes waited for the store";
  EXPECT_EQ(Job(first).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(FreeSlots("n1") + FreeSlots("n2"), 2) << "placed once, not drained";

  // A job submitted now is admitted by a later pass (its own store waits for the first's).
  const std::string second = Submit(CpuSpec(2, 0));
  cluster_->RequestPass();
  EXPECT_TRUE(AwaitAfterPasses([&] { return FreeSlots("n1") + FreeSlots("n2") == 0; }));
  for (const char* node : {"n1", "n2"}) {
    EXPECT_EQ(Beat(node, {}).start_size(), 0) << node << ": an assignment left before its store";
  }

  release.Notify();
  EXPECT_TRUE(AwaitAfterPasses([&] { return Job(second).state() == v1::JOB_STATE_SCHEDULED; }));
  EXPECT_EQ(Job(first).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(Job(second).state(), v1::JOB_STATE_SCHEDULED);
  cluster_->Stop();
  store_->SetWriteFailureInjector(nullptr);
  std::map<std::string, std::string> started;  // job -> node
  for (const char* node : {"n1", "n2"}) {
    const v1::HeartbeatResponse orders = Beat(node, {});
    for (const auto& start : orders.start()) {
      EXPECT_TRUE(started.emplace(start.trainers(0).job_id(), node).second);
    }
  }
  EXPECT_EQ(started.size(), 2u);
  EXPECT_TRUE(started.contains(first) && started.contains(second));
  EXPECT_GT(overlapped.load(), 0) << "the store thread's time is reported as store_overlapped";
}

// A placement the store thread cannot store is taken back (its devices freed, nothing
// delivered), and a later pass places the job again.
TEST_F(ClusterTest, TheLoopTakesBackAPlacementItCouldNotStoreAndPlacesItAgain) {
  UseFileStoreAndFastLoop();
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  std::atomic<int> failed{0};
  store_->SetWriteFailureInjector([&](const std::string& id) {
    if (id == job_id && failed.load() == 0) {
      ++failed;
      return absl::UnavailableError("injected: disk gone");
    }
    return absl::OkStatus();
  });
  StartLoop();
  AwaitAfterPasses([&] { return Job(job_id).state() == v1::JOB_STATE_SCHEDULED; });
  cluster_->Stop();
  store_->SetWriteFailureInjector(nullptr);
  EXPECT_EQ(failed.load(), 1);
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(FreeSlots("n1"), 0);
  const v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_EQ(orders.start_size(), 1) << "one start: the placement taken back was never delivered";
  EXPECT_EQ(orders.start(0).trainers(0).job_id(), job_id);
}

// Under Start(), with each pass's placements stored beside the next pass: random submissions,
// cancellations and heartbeats (a task reported RUNNING, later SUCCEEDED; stopped when told)
// never deliver a start whose placement is not stored, never deliver a task twice, never hand
// out more slots than a node has, and every job ends with every slot free again.
TEST_F(ClusterTest, TheLoopKeepsDeliveriesAndTheStoreInStepUnderRandomChanges) {
  UseFileStoreAndFastLoop();
  const std::vector<std::string> nodes = {"n1", "n2", "n3"};
  constexpr int kSlots = 4;
  for (const auto& node : nodes) Register(node, kSlots);
  StartLoop();
  std::mt19937 rng(20261128);
  auto chance = [&](int percent) {
    return std::uniform_int_distribution<int>(0, 99)(rng) < percent;
  };
  std::vector<std::string> jobs;
  std::set<std::string> delivered;
  // node -> task_id -> the status the node reports next
  std::map<std::string, std::map<std::string, v1::TaskStatus>> tasks;
  int starts = 0, stops = 0, cancels = 0;
  auto beat = [&](const std::string& node) {
    std::vector<v1::TaskStatus> listed;
    for (const auto& [task_id, status] : tasks[node]) listed.push_back(status);
    const v1::HeartbeatResponse orders = Beat(node, listed);
    for (auto it = tasks[node].begin(); it != tasks[node].end();) {
      // A task reported ended is forgotten; a running one may end before the next heartbeat.
      if (it->second.state() == v1::TASK_STATE_SUCCEEDED) {
        it = tasks[node].erase(it);
        continue;
      }
      if (chance(30)) it->second.set_state(v1::TASK_STATE_SUCCEEDED);
      ++it;
    }
    for (const auto& task_id : orders.stop()) {
      stops += static_cast<int>(tasks[node].erase(task_id));
    }
    for (const auto& start : orders.start()) {
      ++starts;
      const v1::TrainerTask& trainer = start.trainers(0);
      EXPECT_TRUE(delivered.insert(start.task_id()).second)
          << start.task_id() << " was delivered twice";
      // Its placement was stored before it left (a cancellation may have come since).
      const v1::Job stored = Job(trainer.job_id());
      EXPECT_NE(stored.state(), v1::JOB_STATE_PENDING) << start.task_id();
      EXPECT_EQ(stored.attempt(), trainer.attempt()) << start.task_id();
      EXPECT_TRUE(std::any_of(stored.placements().begin(), stored.placements().end(),
                              [&](const auto& p) { return p.node_id() == node; }))
          << start.task_id() << " left for " << node << " without a stored placement there";
      tasks[node][start.task_id()] =
          Task(trainer.job_id(), trainer.attempt(), node, v1::TASK_STATE_RUNNING);
    }
    const int free = FreeSlots(node);
    EXPECT_GE(free, 0) << node;
    EXPECT_LE(free, kSlots) << node;
  };
  for (int i = 0; i < 300; ++i) {
    if (chance(35)) {
      // 1, 2 or 4 ranks (the spec's global batch of 8 divides among them), on one node or two.
      jobs.push_back(Submit(CpuSpec(1 << std::uniform_int_distribution<int>(0, 2)(rng), 0)));
      cluster_->RequestPass();
    }
    if (!jobs.empty() && chance(8)) {
      const std::string& job_id =
          jobs[std::uniform_int_distribution<size_t>(0, jobs.size() - 1)(rng)];
      cancels += jobs_->Cancel(job_id, "test").ok() ? 1 : 0;
    }
    beat(nodes[std::uniform_int_distribution<size_t>(0, nodes.size() - 1)(rng)]);
    // Varies how far the loop gets between the test's changes, without real time.
    for (int y = std::uniform_int_distribution<int>(0, 300)(rng); y > 0; --y) {
      std::this_thread::yield();
    }
  }
  // No more submissions: every job runs to its end (or was cancelled), and every slot frees.
  auto all_ended = [&] {
    for (const auto& job_id : jobs) {
      if (!IsTerminal(Job(job_id).state())) return false;
    }
    for (const auto& node : nodes) {
      if (FreeSlots(node) != kSlots) return false;
    }
    return true;
  };
  for (int i = 0; i < 3000 && !all_ended(); ++i) {
    for (const auto& node : nodes) beat(node);
    cluster_->RequestPass();
    AwaitPasses(Passes() + 1);
  }
  cluster_->Stop();
  EXPECT_TRUE(all_ended());
  for (const auto& job_id : jobs) {
    const v1::JobState state = Job(job_id).state();
    EXPECT_TRUE(state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_CANCELLED)
        << job_id << " " << v1::JobState_Name(state);
  }
  // The run exercised what it is about.
  EXPECT_GT(jobs.size(), 60u);
  EXPECT_GT(starts, 60);
  EXPECT_GT(cancels, 5);
}

// Changes to different jobs never wait for each other: a batch of 200 transitions (what a pass
// stores) completes while another job's change is stuck before its commit. (With the 64 hashed
// stripes this replaced, one of 200 jobs shared the stuck job's stripe nearly every time.)
TEST_F(ClusterTest, AJobsStuckChangeHoldsUpNoOtherJob) {
  const std::string stuck = Submit(CpuSpec(2, 0));
  std::vector<std::string> others;
  for (int i = 0; i < 200; ++i) others.push_back(Submit(CpuSpec(2, 0)));
  absl::Notification entered, release;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    if (id == stuck) {
      entered.Notify();
      release.WaitForNotification();
    }
    return absl::OkStatus();
  });
  std::thread change([&] {
    EXPECT_THAT(jobs_->Transition(stuck, v1::JOB_STATE_PENDING, "stuck").status(), IsOk());
  });
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::vector<JobManager::TransitionRequest> requests;
  for (const auto& job_id : others) {
    requests.push_back({.job_id = job_id, .state = v1::JOB_STATE_PENDING, .reason = "batch"});
  }
  absl::Notification done;
  std::thread batch([&] {
    for (const auto& result : jobs_->TransitionAll(requests)) EXPECT_THAT(result.status(), IsOk());
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "the batch waited for another job's change";
  release.Notify();
  change.join();
  batch.join();
  store_->SetWriteFailureInjector(nullptr);
  EXPECT_EQ(Job(others.back()).reason(), "batch");
  EXPECT_EQ(Job(stuck).reason(), "stuck");
}

// No store write is made under the cluster lock. Every write (placements, a job to RUNNING, a
// restart decided, a success recorded by a heartbeat and one retried by a pass, a move, node
// records of registrations, drains and lost nodes) checks, while it runs, that a heartbeat from
// another node still completes: a write made under the lock would hold that heartbeat until it
// returned.
TEST_F(ClusterTest, NoStoreWriteHoldsTheClusterLock) {
  Register("watch", 1);
  Register("n1", 2);
  Register("n2", 2);
  absl::Mutex mu;
  int writes = 0;
  std::set<std::string> written;        // ids of the writes checked
  std::vector<std::string> held;        // ids of the writes a heartbeat waited for
  std::vector<std::thread> heartbeats;  // joined at the end (one held waits for its write)
  std::string fail_once;                // a write of this id fails once
  store_->SetWriteFailureInjector([&](const std::string& id) {
    auto done = std::make_shared<absl::Notification>();
    std::thread beat([this, done] {
      v1::HeartbeatRequest request;
      request.set_node_id("watch");
      EXPECT_THAT(cluster_->Heartbeat(request).status(), IsOk());
      done->Notify();
    });
    const bool completed = done->WaitForNotificationWithTimeout(absl::Seconds(2));
    absl::MutexLock lock(&mu);
    ++writes;
    written.insert(id);
    if (!completed) held.push_back(id);
    heartbeats.push_back(std::move(beat));
    if (id == fail_once) {
      fail_once.clear();
      return absl::UnavailableError("injected");
    }
    return absl::OkStatus();
  });
  auto placed_on = [&](const std::string& job_id) { return Job(job_id).placements(0).node_id(); };

  // Placed, RUNNING, failed, restarted (decided by a pass), placed again.
  const std::string restarted = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  std::string node = placed_on(restarted);
  StartOn(restarted, 0, node);
  v1::TaskStatus failed = Task(restarted, 0, node, v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 0, node, Now());
  Beat(node, {failed});
  cluster_->Tick();
  ASSERT_EQ(Job(restarted).restarts(), 1);
  ASSERT_EQ(Job(restarted).state(), v1::JOB_STATE_SCHEDULED);
  // Its success cannot be recorded by the heartbeat; the next pass records it.
  node = placed_on(restarted);
  StartOn(restarted, 1, node);
  {
    absl::MutexLock lock(&mu);
    fail_once = restarted;
  }
  Beat(node, {Task(restarted, 1, node, v1::TASK_STATE_SUCCEEDED)});
  cluster_->Tick();
  ASSERT_EQ(Job(restarted).state(), v1::JOB_STATE_SUCCEEDED);

  // A drain with checkpoint moves a job; undrained afterwards.
  const std::string moved = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  node = placed_on(moved);
  StartOn(moved, 0, node);
  ASSERT_THAT(cluster_->DrainNode(node, /*checkpoint=*/true, "test").status(), IsOk());
  Beat(node, {Task(moved, 0, node, v1::TASK_STATE_STOPPED)});
  cluster_->Tick();
  ASSERT_EQ(Job(moved).attempt(), 1);
  ASSERT_THAT(cluster_->UndrainNode(node).status(), IsOk());

  // Every node goes silent and is lost; one registers again.
  clock_.Advance(absl::Seconds(11));
  cluster_->Tick();
  Register("n1", 2);

  store_->SetWriteFailureInjector(nullptr);
  absl::MutexLock lock(&mu);
  for (auto& heartbeat : heartbeats) heartbeat.join();
  EXPECT_THAT(held, ::testing::IsEmpty()) << "writes made under the cluster lock";
  for (const std::string id : {"watch", "n1", "n2"}) {
    EXPECT_TRUE(written.contains(id)) << "node record " << id << " not checked";
  }
  EXPECT_TRUE(written.contains(restarted) && written.contains(moved));
  EXPECT_GE(writes, 15);
}

// The scheduling latency and the oldest pending job's age are measured on the cluster's clock
// (the job manager stamps submissions with the same one).
TEST_F(ClusterTest, LatencyAndPendingAgeComeFromTheClock) {
  std::vector<double> latencies;
  cluster_->SetSchedulingLatencyObserver([&](double seconds) { latencies.push_back(seconds); });
  const std::string job_id = Submit(CpuSpec(2, 0));
  clock_.Advance(absl::Seconds(3));
  EXPECT_EQ(cluster_->Tick().oldest_pending_seconds, 3.0) << "no node yet";
  Register("n1", 2);
  clock_.Advance(absl::Seconds(2));
  const ClusterStats stats = cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(stats.oldest_pending_seconds, 0.0);
  EXPECT_THAT(latencies, ElementsAre(5.0));
}

// The scheduler's decisions reach the notifier for the nodes concerned (so their workers
// heartbeat at once); an order queued while the node's own heartbeat is handled leaves with that
// heartbeat's response and is not announced (else a worker would heartbeat again and again).
TEST_F(ClusterTest, OrdersAreAnnouncedToTheirNodeOnly) {
  AssignmentNotifier notifier;
  cluster_->SetAssignmentNotifier(&notifier);
  absl::Mutex mu;
  std::map<std::string, int> notices;
  for (const std::string node : {"n1", "n2"}) {
    notifier.Subscribe(node, [&mu, &notices, node] {
      absl::MutexLock lock(&mu);
      ++notices[node];
    });
  }
  // The dispatcher runs on its own thread: wait (bounded) for the count to settle.
  auto count = [&](const std::string& node, int want) {
    absl::MutexLock lock(&mu);
    const auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return notices[node] == want; };
    mu.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(10));
    return notices[node];
  };
  Register("n1", 2);
  Register("n2", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  ASSERT_EQ(Job(job_id).placements_size(), 2);
  const std::string node = Job(job_id).placements(0).node_id();
  const std::string other = node == "n1" ? "n2" : "n1";
  EXPECT_EQ(count(node, 1), 1);

  // The start goes out with the next heartbeat; a stale task it reports gets a stop order in the
  // same response, unannounced.
  v1::HeartbeatResponse orders = Beat(node, {Task("old-job", 0, node, v1::TASK_STATE_RUNNING)});
  EXPECT_THAT(orders.start(), SizeIs(1));
  EXPECT_THAT(orders.stop(), ElementsAre("old-job/0/" + node));
  Beat(node, {Task(job_id, 0, node, v1::TASK_STATE_RUNNING)});

  // Cancelling drains the attempt: the stop order is announced.
  ASSERT_THAT(jobs_->Cancel(job_id, "test").status(), IsOk());
  cluster_->Tick();
  EXPECT_EQ(count(node, 2), 2);
  Flush(notifier);  // every notice given so far delivered
  EXPECT_EQ(count(other, 0), 0);
  cluster_->SetAssignmentNotifier(nullptr);
}

TEST_F(ClusterTest, ANodeRegisteringAgainWhileItsPlacementIsStoredIsNotDoubleBooked) {
  Register("n1", 2);
  const std::string first = Submit(CpuSpec(2, 0));
  // The pass stores its placements without the cluster lock; n1's worker restarts and registers
  // again in between (the injector runs as the placement is about to be written).
  bool registered_again = false;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    if (id == first && !registered_again) {
      registered_again = true;
      Register("n1", 2);
    }
    return absl::OkStatus();
  });
  cluster_->Tick();
  store_->SetWriteFailureInjector(nullptr);
  ASSERT_TRUE(registered_again);
  EXPECT_EQ(Job(first).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(FreeSlots("n1"), 0) << "the placement still holds both slots";
  // A second job does not get the same slots.
  const std::string second = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  EXPECT_EQ(Job(second).state(), v1::JOB_STATE_PENDING);
  // The first job's assignment is handed out once, to the node as it registered again.
  v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).task_id(), absl::StrCat(first, "/0/n1"));
  EXPECT_THAT(Beat("n1", {Task(first, 0, "n1", v1::TASK_STATE_RUNNING)}).start(), SizeIs(0));
}

TEST_F(ClusterTest, APlacementThatCannotBeStoredIsTakenBack) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string failing = Submit(CpuSpec(2, 0));
  const std::string other = Submit(CpuSpec(2, 0));
  bool fail = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail && id == failing ? absl::UnavailableError("injected: disk full") : absl::OkStatus();
  });
  cluster_->Tick();
  EXPECT_EQ(Job(failing).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(other).state(), v1::JOB_STATE_SCHEDULED) << "one failed write spares the others";
  const std::string other_node = Job(other).placements(0).node_id();
  const std::string free_node = other_node == "n1" ? "n2" : "n1";
  EXPECT_EQ(FreeSlots(free_node), 2) << "the failed placement holds nothing";
  EXPECT_THAT(Beat(free_node, {}).start(), SizeIs(0)) << "nothing unstored is handed out";
  fail = false;
  cluster_->Tick();
  EXPECT_EQ(Job(failing).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(Beat(free_node, {}).start(), SizeIs(1));
}

TEST(ClusterStoreTest, APassStoresItsPlacementsInOneTransactionThatSurvivesARestart) {
  tessera::testing::ScopedTempDir dir("cluster");
  const std::string path = dir.path() + "/coordinator.db";
  std::vector<std::string> job_ids;
  {
    auto store = Store::Open(path);
    ASSERT_THAT(store.status(), IsOk());
    JobManager jobs(store->get());
    Cluster cluster(store->get(), &jobs, ClusterOptions());
    for (int n = 0; n < 4; ++n) {
      v1::RegisterNodeRequest request;
      request.set_node_id(absl::StrCat("n", n));
      request.set_address(absl::StrCat("n", n, ":7000"));
      request.mutable_resources()->set_cpu_slots(2);
      ASSERT_THAT(cluster.Register(request).status(), IsOk());
    }
    for (int j = 0; j < 4; ++j) {
      auto job = jobs.Submit(CpuSpec(2, 0), "");
      ASSERT_THAT(job.status(), IsOk());
      job_ids.push_back(job->job_id());
    }
    int transactions = 0;
    (*store)->SetWriteObserver([&](const StoreWriteStats&) { ++transactions; });
    cluster.Tick();
    (*store)->SetWriteObserver(nullptr);
    EXPECT_EQ(transactions, 1) << "four placements, one transaction";
  }
  // A coordinator started again on the file finds every placement and holds its devices.
  auto store = Store::Open(path);
  ASSERT_THAT(store.status(), IsOk());
  JobManager jobs(store->get());
  Cluster cluster(store->get(), &jobs, ClusterOptions());
  ASSERT_THAT(cluster.Recover(), IsOk());
  std::set<std::string> nodes;
  for (const auto& job_id : job_ids) {
    auto job = jobs.Get(job_id);
    ASSERT_THAT(job.status(), IsOk());
    EXPECT_EQ(job->state(), v1::JOB_STATE_SCHEDULED);
    ASSERT_THAT(job->placements(), SizeIs(2));
    nodes.insert(job->placements(0).node_id());
  }
  EXPECT_THAT(nodes, SizeIs(4));
  for (const auto& node : cluster.Nodes(true)) EXPECT_EQ(node.free_cpu_slots(), 0);
}

// Master ports survive a coordinator restart: three jobs on one node hold 29500-29502, the middle
// one ends, the coordinator restarts. A new job must get 29501, not a port a running job holds
// (a recovered coordinator used to hand out the lowest ports again in job order, here 29502).
TEST(ClusterStoreTest, ARestartedCoordinatorKeepsTheMasterPortsInUse) {
  tessera::testing::ScopedTempDir dir("cluster-ports");
  const std::string path = dir.path() + "/coordinator.db";
  std::vector<std::string> job_ids;
  v1::RegisterNodeRequest node;
  node.set_node_id("n0");
  node.set_address("n0:7000");
  node.mutable_resources()->set_cpu_slots(4);
  {
    auto store = Store::Open(path);
    ASSERT_THAT(store.status(), IsOk());
    JobManager jobs(store->get());
    Cluster cluster(store->get(), &jobs, ClusterOptions());
    ASSERT_THAT(cluster.Register(node).status(), IsOk());
    for (int j = 0; j < 3; ++j) {
      auto job = jobs.Submit(CpuSpec(1, 0), "");
      ASSERT_THAT(job.status(), IsOk());
      job_ids.push_back(job->job_id());
    }
    cluster.Tick();
    v1::HeartbeatRequest beat;
    beat.set_node_id("n0");
    for (int j = 0; j < 3; ++j) {
      auto job = jobs.Get(job_ids[j]);
      ASSERT_THAT(job.status(), IsOk());
      ASSERT_EQ(job->master_port(), 29500 + j);
      v1::TaskStatus* task = beat.add_tasks();
      task->set_task_id(absl::StrCat(job_ids[j], "/0/n0"));
      task->set_job_id(job_ids[j]);
      task->set_state(j == 1 ? v1::TASK_STATE_SUCCEEDED : v1::TASK_STATE_RUNNING);
    }
    ASSERT_THAT(cluster.Heartbeat(beat).status(), IsOk());
    auto ended = jobs.Get(job_ids[1]);
    ASSERT_THAT(ended.status(), IsOk());
    ASSERT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED);
  }
  auto store = Store::Open(path);
  ASSERT_THAT(store.status(), IsOk());
  JobManager jobs(store->get());
  Cluster cluster(store->get(), &jobs, ClusterOptions());
  ASSERT_THAT(cluster.Recover(), IsOk());
  auto job = jobs.Submit(CpuSpec(1, 0), "");
  ASSERT_THAT(job.status(), IsOk());
  cluster.Tick();
  auto placed = jobs.Get(job->job_id());
  ASSERT_THAT(placed.status(), IsOk());
  ASSERT_EQ(placed->state(), v1::JOB_STATE_SCHEDULED) << placed->reason();
  EXPECT_EQ(placed->master_port(), 29501);
}

TEST_F(ClusterTest, RequestPassRunsAPassWithoutWaitingForTheRegularOne) {
  ClusterOptions options;
  options.tick_interval = absl::Hours(1);
  options.min_tick_gap = absl::ZeroDuration();
  Cluster cluster(store_.get(), jobs_.get(), options);
  v1::RegisterNodeRequest request;
  request.set_node_id("n9");
  request.set_address("n9:7000");
  request.mutable_resources()->set_cpu_slots(2);
  ASSERT_THAT(cluster.Register(request).status(), IsOk());
  const std::string job_id = Submit(CpuSpec(2, 0));
  absl::Notification placed;
  cluster.Start([&](const ClusterStats& stats, double) {
    auto scheduled = stats.jobs.find(v1::JOB_STATE_SCHEDULED);
    if (scheduled != stats.jobs.end() && scheduled->second > 0 && !placed.HasBeenNotified()) {
      placed.Notify();
    }
  });
  cluster.RequestPass();
  // Without the request, the first pass would come an hour from now.
  placed.WaitForNotification();
  cluster.Stop();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
}

}  // namespace
}  // namespace tessera::coordinator
