// In-process tests of the coordinator's control loop (Cluster with its NodeRegistry and
// AllocationLedger) and of the attempt policy: an in-memory store, a clock the test moves, and
// workers played by the test through Register / Heartbeat / Report. No processes, no sleeps.

#include "coordinator/cluster.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "coordinator/assignment_notifier.h"
#include "coordinator/attempt_policy.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::google::protobuf::util::TimeUtil;
using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::SizeIs;

google::protobuf::Timestamp At(absl::Time time) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

v1::JobSpec CpuSpec(int slots, int max_restarts) {
  return testing::TinyCpuJobSpec("restartable", slots, max_restarts);
}

v1::TrainerFailure Failure(v1::FailureKind kind, int rank, const std::string& node, absl::Time time,
                           const std::string& message = "") {
  v1::TrainerFailure failure;
  failure.set_kind(kind);
  failure.set_rank(rank);
  failure.set_node_id(node);
  failure.set_message(message);
  *failure.mutable_time() = At(time);
  return failure;
}

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto store = Store::Open(":memory:");
    ASSERT_THAT(store.status(), IsOk());
    store_ = std::move(*store);
    jobs_ = std::make_unique<JobManager>(store_.get(), &clock_);
    ClusterOptions options;
    options.heartbeat_timeout = absl::Seconds(10);
    options.failure_settle = absl::Seconds(5);
    options.blame_grace = absl::Seconds(1);
    options.checkpoint_root = "/ckpt";
    options.clock = &clock_;
    cluster_ = std::make_unique<Cluster>(store_.get(), jobs_.get(), options);
  }

  void Register(const std::string& node, int slots) {
    v1::RegisterNodeRequest request;
    request.set_node_id(node);
    request.set_address(node + ":7000");
    request.mutable_resources()->set_cpu_slots(slots);
    ASSERT_THAT(cluster_->Register(request).status(), IsOk());
  }

  std::string Submit(const v1::JobSpec& spec) {
    auto job = jobs_->Submit(spec, "");
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? job->job_id() : "";
  }

  // A heartbeat from `node` with the given task states; returns the orders it gets back.
  v1::HeartbeatResponse Beat(const std::string& node, const std::vector<v1::TaskStatus>& tasks) {
    v1::HeartbeatRequest request;
    request.set_node_id(node);
    for (const auto& task : tasks) *request.add_tasks() = task;
    auto response = cluster_->Heartbeat(request);
    EXPECT_THAT(response.status(), IsOk());
    return response.ok() ? *response : v1::HeartbeatResponse();
  }

  static v1::TaskStatus Task(const std::string& job_id, int attempt, const std::string& node,
                             v1::TaskState state) {
    v1::TaskStatus status;
    status.set_task_id(absl::StrCat(job_id, "/", attempt, "/", node));
    status.set_job_id(job_id);
    status.set_attempt(attempt);
    status.set_state(state);
    return status;
  }

  v1::Job Job(const std::string& job_id) {
    auto job = jobs_->Get(job_id);
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? *job : v1::Job();
  }

  int FreeSlots(const std::string& node) {
    for (const auto& n : cluster_->Nodes(true)) {
      if (n.node_id() == node) return n.free_cpu_slots();
    }
    return -1;
  }

  // Reports of one relayed batch from `node`, sequence numbers from `first`.
  absl::StatusOr<v1::ReportResponse> Relay(const std::string& node, const std::string& job_id,
                                           int attempt, int64_t first,
                                           const std::vector<v1::TrainerReport>& reports) {
    v1::ReportRequest request;
    request.set_node_id(node);
    request.set_task_id(absl::StrCat(job_id, "/", attempt, "/", node));
    request.set_first_sequence(first);
    for (auto report : reports) {
      report.set_job_id(job_id);
      report.set_attempt(attempt);
      *request.add_reports() = report;
    }
    return cluster_->Report(request);
  }

  static v1::TrainerReport Step(int64_t step, double loss) {
    v1::TrainerReport report;
    report.mutable_metrics()->set_step(step);
    report.mutable_metrics()->set_loss(loss);
    return report;
  }

  static v1::TrainerReport CheckpointAt(int64_t step) {
    v1::TrainerReport report;
    report.mutable_checkpoint()->set_step(step);
    report.mutable_checkpoint()->set_path(absl::StrCat("/ckpt/step-", step));
    return report;
  }

  // Runs the job's attempt `attempt` on `node` up to RUNNING.
  void StartOn(const std::string& job_id, int attempt, const std::string& node) {
    v1::HeartbeatResponse orders = Beat(node, {});
    ASSERT_THAT(orders.start(), SizeIs(1));
    EXPECT_EQ(orders.start(0).task_id(), absl::StrCat(job_id, "/", attempt, "/", node));
    Beat(node, {Task(job_id, attempt, node, v1::TASK_STATE_RUNNING)});
  }

  std::vector<v1::JobEvent> Events(const std::string& job_id) {
    auto events = jobs_->Events(job_id, 0, 0);
    EXPECT_THAT(events.status(), IsOk());
    return events.ok() ? *events : std::vector<v1::JobEvent>();
  }

  // The store on a file (its reads on their own connections, not behind a blocked write) and a
  // cluster whose loop (Start) passes every 10 ms, for the tests of the loop.
  void UseFileStoreAndFastLoop() {
    cluster_.reset();
    jobs_.reset();
    store_.reset();
    dir_.emplace("cluster-loop");
    auto store = Store::Open(dir_->path() + "/coordinator.db");
    ASSERT_THAT(store.status(), IsOk());
    store_ = std::move(*store);
    jobs_ = std::make_unique<JobManager>(store_.get(), &clock_);
    ClusterOptions options;
    options.tick_interval = absl::Milliseconds(10);
    options.min_tick_gap = absl::ZeroDuration();
    options.clock = &clock_;
    cluster_ = std::make_unique<Cluster>(store_.get(), jobs_.get(), options);
  }

  // The store's first write of `job_id` notifies `storing` and then waits for `release`.
  void BlockFirstWriteOf(const std::string& job_id, absl::Notification& storing,
                         absl::Notification& release) {
    store_->SetWriteFailureInjector([job_id, &storing, &release](const std::string& id) {
      if (id == job_id && !storing.HasBeenNotified()) {
        storing.Notify();
        release.WaitForNotification();
      }
      return absl::OkStatus();
    });
  }

  absl::Time Now() const { return clock_.Now(); }

  // Returns once `notifier` has made every call noticed before this one: its dispatcher calls
  // the subscribers one at a time, in the order their notices came.
  static void Flush(AssignmentNotifier& notifier) {
    absl::Notification flushed;
    const AssignmentNotifier::Handle handle =
        notifier.Subscribe("flush-barrier", [&flushed] { flushed.Notify(); });
    notifier.Notify("flush-barrier");
    EXPECT_TRUE(flushed.WaitForNotificationWithTimeout(absl::Seconds(30)));
    notifier.Unsubscribe(handle);
  }

  // Cluster::Start with `observer` (may be null), counting the loop's passes for the waits below.
  void StartLoop(std::function<void(const ClusterStats&, double)> observer = nullptr) {
    cluster_->Start(
        [this, observer = std::move(observer)](const ClusterStats& stats, double seconds) {
          if (observer) observer(stats, seconds);
          absl::MutexLock lock(&passes_mu_);
          ++passes_;
        });
  }
  int Passes() {
    absl::MutexLock lock(&passes_mu_);
    return passes_;
  }
  // Waits (at most `timeout`) until the loop has made `passes` passes in all.
  bool AwaitPasses(int passes, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&passes_mu_);
    const auto reached = [this, passes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(passes_mu_) {
      return passes_ >= passes;
    };
    return passes_mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
  }
  // Waits (at most `timeout`) until `done` holds, checking it after each pass of the loop, and at
  // least every 10 ms: a pass may change what `done` reads and then block (its store waits for
  // the previous one's), so its end is not always the moment to look.
  bool AwaitAfterPasses(const std::function<bool()>& done,
                        absl::Duration timeout = absl::Seconds(30)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!done()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      AwaitPasses(Passes() + 1, std::min(left, absl::Milliseconds(10)));
    }
    return true;
  }

  SimulatedClock clock_{absl::FromUnixSeconds(1'800'000'000)};
  absl::Mutex passes_mu_;
  int passes_ ABSL_GUARDED_BY(passes_mu_) = 0;
  std::optional<tessera::testing::ScopedTempDir> dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(ClusterTest, SilentNodeIsLostAndAskedToRegisterAgain) {
  Register("n1", 2);
  clock_.Advance(absl::Seconds(9));
  cluster_->Tick();
  EXPECT_EQ(cluster_->Nodes(false).size(), 1u);
  clock_.Advance(absl::Seconds(2));  // 11 s since the last heartbeat, timeout 10 s
  ClusterStats stats = cluster_->Tick();
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_LOST], 1);
  EXPECT_TRUE(cluster_->Nodes(false).empty());
  EXPECT_TRUE(Beat("n1", {}).reregister());
}

// A heartbeat's GPU metrics replace the node's (they are copied before the cluster lock and
// swapped in under it); a heartbeat with a wrong key changes nothing.
TEST_F(ClusterTest, HeartbeatGpuMetricsReplaceTheNodesLast) {
  v1::RegisterNodeRequest request;
  request.set_node_id("n1");
  request.set_address("n1:7000");
  request.set_node_key("k1");
  request.mutable_resources()->set_cpu_slots(2);
  ASSERT_THAT(cluster_->Register(request).status(), IsOk());
  auto beat = [&](const std::string& key, std::vector<double> utilization) {
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_node_id("n1");
    heartbeat.set_node_key(key);
    for (size_t i = 0; i < utilization.size(); ++i) {
      v1::GpuMetrics* gpu = heartbeat.add_gpu_metrics();
      gpu->set_index(static_cast<int>(i));
      gpu->set_utilization_percent(utilization[i]);
    }
    return cluster_->Heartbeat(heartbeat).status();
  };
  auto utilization = [&] {
    std::vector<double> out;
    const std::vector<v1::Node> nodes = cluster_->Nodes(false);
    for (const auto& gpu : nodes.at(0).gpu_metrics()) {
      out.push_back(gpu.utilization_percent());
    }
    return out;
  };
  ASSERT_THAT(beat("k1", {10, 20}), IsOk());
  EXPECT_EQ(utilization(), (std::vector<double>{10, 20}));
  ASSERT_THAT(beat("k1", {30}), IsOk());
  EXPECT_EQ(utilization(), (std::vector<double>{30}));
  EXPECT_EQ(beat("other", {99, 99}).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(utilization(), (std::vector<double>{30}));
  ASSERT_THAT(beat("k1", {}), IsOk());
  EXPECT_TRUE(utilization().empty());
}

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
    absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<int>(0, 3000)(rng)));
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
  for (const auto& job_id : others) requests.push_back({job_id, v1::JOB_STATE_PENDING, "batch"});
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

TEST_F(ClusterTest, KilledRankRestartsFromTheCheckpointBlamingTheKilledRank) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 2));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {Step(1, 5.0), Step(2, 4.0), CheckpointAt(2), Step(3, 3.5)})
                  .status(),
              IsOk());
  EXPECT_EQ(Job(job_id).current_step(), 3);
  // Rank 0 reports its peer's loss first; the worker's record of rank 1's death comes later but
  // happened earlier, and is a cause, not a consequence.
  v1::TrainerReport peer;
  *peer.mutable_failure() =
      Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now(), "Connection closed by peer");
  ASSERT_THAT(Relay("n1", job_id, 0, 5, {peer}).status(), IsOk());
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n1",
                                      Now() - absl::Milliseconds(50), "killed by signal 9");
  failed.mutable_failure()->set_signal(9);
  Beat("n1", {failed});
  cluster_->Tick();  // every node ended: decided at once

  v1::Job job = Job(job_id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.current_step(), 2) << "metrics go on from the checkpoint's step";
  ASSERT_THAT(job.attempts(), SizeIs(1));
  EXPECT_EQ(job.attempts(0).reason(), "rank 1 on n1 was killed by signal 9 (SIGKILL) at step 3");
  ASSERT_THAT(job.attempts(0).consequences(), SizeIs(1));
  EXPECT_EQ(job.attempts(0).consequences(0).kind(), v1::FAILURE_KIND_PEER_FAILED);
  // The devices came back and the next attempt was placed in the same pass.
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(job.reason(), HasSubstr("attempt 1 placed on n1, resuming from the checkpoint of "
                                      "step 2"));
  StartOn(job_id, 1, "n1");
  // A straggling report of attempt 0 is stopped, not counted.
  v1::HeartbeatResponse orders = Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING),
                                             Task(job_id, 1, "n1", v1::TASK_STATE_RUNNING)});
  EXPECT_THAT(orders.stop(), ElementsAre(absl::StrCat(job_id, "/0/n1")));
  ASSERT_THAT(Relay("n1", job_id, 1, 1, {Step(3, 3.4), Step(4, 3.0)}).status(), IsOk());
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  ASSERT_THAT(job.attempts(), SizeIs(2));
  EXPECT_EQ(job.attempts(1).start_step(), 2);
  EXPECT_EQ(job.attempts(1).end_step(), 4);
  EXPECT_EQ(FreeSlots("n1"), 2);

  // The watch stream: each step once per attempt that trained it, the restart in between.
  std::vector<int64_t> steps;
  std::vector<v1::JobState> states;
  for (const auto& event : Events(job_id)) {
    if (event.has_metrics()) steps.push_back(event.metrics().step());
    if (event.has_state_change()) states.push_back(event.state_change().new_state());
  }
  EXPECT_THAT(steps, ElementsAre(1, 2, 3, 3, 4));
  EXPECT_THAT(states,
              ElementsAre(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING,
                          v1::JOB_STATE_RESTARTING, v1::JOB_STATE_SCHEDULED, v1::JOB_STATE_RUNNING,
                          v1::JOB_STATE_SUCCEEDED));
}

// A restart's rank 0 rendezvouses on another port than the failed attempt's: whatever held that
// one (the old rank 0 on its way out, a process that is not ours) may still.
TEST_F(ClusterTest, ARestartTakesAnotherMasterPortThanTheFailedAttempt) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), 29500);
  EXPECT_EQ(Job(job_id).master_port(), 29500) << "stored with the placement";
  Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING)});
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 0, "n1", Now(),
                                      "rendezvous: EADDRINUSE, address already in use");
  Beat("n1", {failed});
  cluster_->Tick();
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).trainers(0).attempt(), 1);
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), 29501);
  EXPECT_EQ(Job(job_id).master_port(), 29501);
}

TEST_F(ClusterTest, NextAttemptWaitsUntilEveryTaskOfTheFailedOneStopped) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 0, "n1", Now());
  Beat("n1", {failed});
  clock_.Advance(absl::Seconds(1));  // the blame grace: the cause is known
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RESTARTING);
  v1::HeartbeatResponse orders = Beat("n2", {Task(job_id, 0, "n2", v1::TASK_STATE_RUNNING)});
  EXPECT_THAT(orders.stop(), ElementsAre(absl::StrCat(job_id, "/0/n2")));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RESTARTING) << "n2 still runs attempt 0";
  EXPECT_EQ(FreeSlots("n2"), 0);
  Beat("n2", {Task(job_id, 0, "n2", v1::TASK_STATE_STOPPED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(Job(job_id).attempt(), 1);
}

TEST_F(ClusterTest, CauseReportedByAnotherNodeWithinTheGraceIsBlamed) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  // n1's rank reports its peer gone; n2's worker reports the killed rank a heartbeat later.
  v1::TaskStatus consequence = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *consequence.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now());
  Beat("n1", {consequence});
  clock_.Advance(absl::Seconds(3));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "only a consequence so far";
  v1::TaskStatus cause = Task(job_id, 0, "n2", v1::TASK_STATE_FAILED);
  *cause.mutable_failure() = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n2",
                                     Now() - absl::Seconds(3), "killed by signal 9");
  cause.mutable_failure()->set_signal(9);
  Beat("n2", {cause});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.failure().rank(), 1);
  EXPECT_EQ(job.failure().node_id(), "n2");
  EXPECT_THAT(job.reason(), HasSubstr("rank 1 on n2 was killed by signal 9"));
  EXPECT_EQ(FreeSlots("n1"), 1);
  EXPECT_EQ(FreeSlots("n2"), 1);
}

TEST_F(ClusterTest, OnlyConsequencesAreBlamedAfterTheSettleTime) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  v1::TrainerReport peer;
  *peer.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now(), "peer lost");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {peer}).status(), IsOk());
  clock_.Advance(absl::Seconds(4));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING);
  clock_.Advance(absl::Seconds(1));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(job_id).failure().kind(), v1::FAILURE_KIND_PEER_FAILED);
}

TEST_F(ClusterTest, NonRetryableFailureEndsTheJobWithRestartsLeft) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 3));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_DATA_ERROR, 0, "n1", Now(), "bad shard");
  Beat("n1", {failed});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_THAT(job.reason(), HasSubstr("not retried"));
}

TEST_F(ClusterTest, JobFailingEveryAttemptStopsAfterMaxRestartsWithEveryReason) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 2));
  cluster_->Tick();
  for (int attempt = 0; attempt <= 2; ++attempt) {
    StartOn(job_id, attempt, "n1");
    v1::TaskStatus failed = Task(job_id, attempt, "n1", v1::TASK_STATE_FAILED);
    *failed.mutable_failure() =
        Failure(v1::FAILURE_KIND_NAN_LOSS, 0, "n1", Now(), absl::StrCat("nan #", attempt));
    Beat("n1", {failed});
    cluster_->Tick();
  }
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.restarts(), 2);
  ASSERT_THAT(job.attempts(), SizeIs(3));
  for (int attempt = 0; attempt <= 2; ++attempt) {
    EXPECT_THAT(job.attempts(attempt).reason(), HasSubstr(absl::StrCat("nan #", attempt)));
  }
  EXPECT_THAT(job.reason(), HasSubstr("no restarts left"));
  EXPECT_EQ(FreeSlots("n1"), 2);
}

TEST_F(ClusterTest, StoreFailuresAreRetriedAndNoAllocationLeaks) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  bool fail_writes = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail_writes && id == job_id ? absl::UnavailableError("injected: database is locked")
                                       : absl::OkStatus();
  });
  v1::TaskStatus failed = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *failed.mutable_failure() = Failure(v1::FAILURE_KIND_OUT_OF_MEMORY, 1, "n1", Now());
  Beat("n1", {failed});
  cluster_->Tick();
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "the decision could not be stored";
  EXPECT_EQ(FreeSlots("n1"), 0) << "the attempt keeps its devices until its end is recorded";
  fail_writes = false;
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).restarts(), 1);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);

  // Success that cannot be recorded at first is recorded by a later tick, and frees the slots.
  StartOn(job_id, 1, "n1");
  fail_writes = true;
  Beat("n1", {Task(job_id, 1, "n1", v1::TASK_STATE_SUCCEEDED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(FreeSlots("n1"), 0);
  fail_writes = false;
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(FreeSlots("n1"), 2);
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

TEST_F(ClusterTest, NodeRecordWriteFailureIsRetried) {
  Register("n1", 2);
  bool fail = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail && id == "n1" ? absl::UnavailableError("injected") : absl::OkStatus();
  });
  clock_.Advance(absl::Seconds(11));
  cluster_->Tick();  // n1 lost; its record cannot be written
  fail = false;
  cluster_->Tick();
  auto nodes = store_->ListNodes();
  ASSERT_THAT(nodes.status(), IsOk());
  ASSERT_THAT(*nodes, SizeIs(1));
  EXPECT_EQ((*nodes)[0].state(), v1::NODE_STATE_LOST);
}

TEST_F(ClusterTest, ResentReportBatchAddsEachStepOnce) {
  Register("n1", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  const std::vector<v1::TrainerReport> batch = {Step(1, 5.0), Step(2, 4.5), CheckpointAt(2)};
  // The worker's first call was stored but its response lost: it sends the batch again, then
  // the batch extended by one report.
  ASSERT_THAT(Relay("n1", job_id, 0, 1, batch).status(), IsOk());
  auto again = Relay("n1", job_id, 0, 1, batch);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->acked_sequence(), 3);
  std::vector<v1::TrainerReport> longer = batch;
  longer.push_back(Step(3, 4.0));
  ASSERT_THAT(Relay("n1", job_id, 0, 1, longer).status(), IsOk());
  std::vector<int64_t> steps;
  int checkpoints = 0;
  for (const auto& event : Events(job_id)) {
    if (event.has_metrics()) steps.push_back(event.metrics().step());
    checkpoints += event.has_checkpoint();
  }
  EXPECT_THAT(steps, ElementsAre(1, 2, 3));
  EXPECT_EQ(checkpoints, 1);
}

TEST_F(ClusterTest, LostNodeRestartsAnAutomaticLayoutOnWhatIsLeft) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 1));
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).plan().world_size(), 2);
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  // n2 goes silent; n1's rank loses its peer.
  for (int i = 0; i < 6; ++i) {
    clock_.Advance(absl::Seconds(2));
    Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_RUNNING)});
    cluster_->Tick();
  }
  v1::TaskStatus consequence = Task(job_id, 0, "n1", v1::TASK_STATE_FAILED);
  *consequence.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", Now());
  Beat("n1", {consequence});
  cluster_->Tick();
  v1::Job job = Job(job_id);
  EXPECT_EQ(job.failure().kind(), v1::FAILURE_KIND_NODE_LOST);
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node n2 was lost"));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(job.plan().world_size(), 1);
  EXPECT_EQ(job.plan().layout().data_parallel(), 1);
  EXPECT_THAT(job.reason(), HasSubstr("re-planned for 1 of the 2 devices"));
  v1::HeartbeatResponse orders = Beat("n1", {});
  ASSERT_THAT(orders.start(), SizeIs(1));
  ASSERT_THAT(orders.start(0).trainers(), SizeIs(1));
  const v1::TrainerTask& task = orders.start(0).trainers(0);
  EXPECT_EQ(task.assignment().world_size(), 1);
  EXPECT_EQ(task.spec().resources().cpu_slots(), 1);
  EXPECT_EQ(task.spec().batch().global_batch_size(), 8) << "the same global batch";
  EXPECT_EQ(task.checkpoint_directory(), "/ckpt/" + job_id);
}

TEST_F(ClusterTest, StragglerIsTheRankWithTheMostBusyTime) {
  Register("n1", 2);
  Register("n2", 1);
  v1::JobSpec spec = CpuSpec(3, 0);
  spec.mutable_batch()->set_global_batch_size(12);
  const std::string job_id = Submit(spec);
  cluster_->Tick();
  v1::HeartbeatResponse n1 = Beat("n1", {});
  v1::HeartbeatResponse n2 = Beat("n2", {});
  ASSERT_EQ(n1.start_size() + n2.start_size(), 2);
  auto with_ranks = [&](const std::string& node, std::vector<std::pair<int, double>> busy) {
    v1::TaskStatus status = Task(job_id, 0, node, v1::TASK_STATE_RUNNING);
    for (const auto& [rank, seconds] : busy) {
      v1::RankStepTime* time = status.add_ranks();
      time->set_rank(rank);
      time->set_step(10);
      time->set_step_seconds(0.5);
      time->set_busy_seconds(seconds);
    }
    return status;
  };
  Beat("n1", {with_ranks("n1", {{0, 0.10}, {1, 0.11}})});
  Beat("n2", {with_ranks("n2", {{2, 0.40}})});
  auto report = cluster_->Straggler(job_id);
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->slowest_rank(), 2);
  EXPECT_EQ(report->slowest_node_id(), "n2");
  EXPECT_NEAR(report->median_busy_seconds(), 0.11, 1e-9);
  EXPECT_NEAR(report->skew(), 0.40 / 0.11, 1e-9);
  EXPECT_TRUE(report->straggling());
  ClusterStats stats = cluster_->Tick();
  ASSERT_TRUE(stats.stragglers.contains(job_id));
  EXPECT_EQ(stats.stragglers[job_id].ranks_size(), 3);
}

TEST(AttemptPolicyTest, BlamesTheEarliestCauseOverEarlierConsequences) {
  const absl::Time t = absl::FromUnixSeconds(100);
  std::vector<v1::TrainerFailure> failures = {
      Failure(v1::FAILURE_KIND_PEER_FAILED, 0, "n1", t),
      Failure(v1::FAILURE_KIND_PROCESS_EXIT, 3, "n2", t + absl::Seconds(2)),
      Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 1, "n1", t + absl::Seconds(1)),
  };
  EXPECT_EQ(BlameIndex(failures), 2u);
  failures.pop_back();
  EXPECT_EQ(BlameIndex(failures), 1u);
  failures.pop_back();
  EXPECT_EQ(BlameIndex(failures), 0u);
}

TEST(AttemptPolicyTest, RetriesWhatARestartCanOutrun) {
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_PROCESS_EXIT));
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_NODE_LOST));
  EXPECT_TRUE(IsRetryable(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT));
  EXPECT_FALSE(IsRetryable(v1::FAILURE_KIND_INVALID_SPEC));
  EXPECT_FALSE(IsRetryable(v1::FAILURE_KIND_DATA_ERROR));
}

TEST(AttemptPolicyTest, DescribesFailuresForPeople) {
  v1::TrainerFailure killed = Failure(v1::FAILURE_KIND_PROCESS_EXIT, 1, "n1", absl::Now());
  killed.set_signal(9);
  killed.set_step(32);
  EXPECT_EQ(DescribeFailure(killed), "rank 1 on n1 was killed by signal 9 (SIGKILL) at step 32");
  v1::TrainerFailure hung = Failure(v1::FAILURE_KIND_COLLECTIVE_TIMEOUT, 2, "n3", absl::Now(),
                                    "rank 2 on n3 hung: no heartbeat for 5.1 s\nmore detail");
  EXPECT_EQ(DescribeFailure(hung),
            "rank 2 on n3 failed: COLLECTIVE_TIMEOUT: rank 2 on n3 hung: no heartbeat for 5.1 s");
  v1::TrainerFailure lost =
      Failure(v1::FAILURE_KIND_NODE_LOST, -1, "n2", absl::Now(), "no heartbeat for 16s");
  EXPECT_EQ(DescribeFailure(lost), "node n2 was lost: no heartbeat for 16s");
}

// A node speaks for its own attempts only, and only with the key it registered with.
TEST_F(ClusterTest, NodesReportOnlyForTheirOwnAttemptsWithTheirKey) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  const std::string placed = Job(job_id).placements(0).node_id();
  const std::string other = placed == "n1" ? "n2" : "n1";
  StartOn(job_id, 0, placed);
  auto forged = Relay(other, job_id, 0, 1, {Step(1, 5.0)});
  EXPECT_EQ(forged.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(forged.status().message(), HasSubstr("which does not run there"));
  EXPECT_THAT(Relay(placed, job_id, 0, 1, {Step(1, 5.0)}).status(), IsOk());
  EXPECT_EQ(Job(job_id).current_step(), 1);

  // n1 registered without a key; a worker with a key cannot take its id over while it lives.
  v1::RegisterNodeRequest takeover;
  takeover.set_node_id("n1");
  takeover.set_address("elsewhere:7000");
  takeover.set_node_key("another-key");
  takeover.mutable_resources()->set_cpu_slots(2);
  EXPECT_EQ(cluster_->Register(takeover).status().code(), absl::StatusCode::kAlreadyExists);
  v1::HeartbeatRequest beat;
  beat.set_node_id("n1");
  beat.set_node_key("another-key");
  EXPECT_EQ(cluster_->Heartbeat(beat).status().code(), absl::StatusCode::kPermissionDenied);
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

namespace tessera::coordinator {
namespace {

// A drained node takes no new placement, runs what it has to its end, and takes work again once
// undrained.
TEST_F(ClusterTest, ADrainedNodeGetsNoNewWorkUntilUndrained) {
  Register("n1", 2);
  const std::string running = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  StartOn(running, 0, "n1");
  auto drained = cluster_->DrainNode("n1", /*checkpoint=*/false, "kernel upgrade");
  ASSERT_THAT(drained.status(), IsOk());
  EXPECT_EQ(drained->node().state(), v1::NODE_STATE_DRAINING);
  EXPECT_THAT(drained->remaining_job_ids(), ElementsAre(running));
  EXPECT_TRUE(drained->moving_job_ids().empty());
  EXPECT_EQ(drained->node().drain_reason(), "kernel upgrade");
  v1::HeartbeatResponse orders = Beat("n1", {Task(running, 0, "n1", v1::TASK_STATE_RUNNING)});
  EXPECT_TRUE(orders.stop().empty()) << "a plain drain stops nothing";
  EXPECT_TRUE(orders.checkpoint_and_stop().empty());
  Beat("n1", {Task(running, 0, "n1", v1::TASK_STATE_SUCCEEDED)});
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_SUCCEEDED);

  const std::string waiting = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  EXPECT_EQ(Job(waiting).state(), v1::JOB_STATE_PENDING) << "the only node is drained";
  EXPECT_TRUE(Beat("n1", {}).start().empty());
  auto undrained = cluster_->UndrainNode("n1");
  ASSERT_THAT(undrained.status(), IsOk());
  EXPECT_EQ(undrained->state(), v1::NODE_STATE_READY);
  cluster_->Tick();
  EXPECT_EQ(Job(waiting).state(), v1::JOB_STATE_SCHEDULED);
  StartOn(waiting, 0, "n1");

  EXPECT_EQ(cluster_->DrainNode("nope", false, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cluster_->UndrainNode("nope").status().code(), absl::StatusCode::kNotFound);
}

// Drain with checkpoint: every node of the attempt is asked to checkpoint and stop (not a plain
// stop); failures while it stops are not blamed; once all its tasks ended, the job goes back to
// the queue from the new checkpoint, is placed off the drained node, and counts no restart.
TEST_F(ClusterTest, DrainWithCheckpointMovesTheJobWithoutCountingARestart) {
  Register("n1", 1);
  Register("n2", 1);
  const std::string job_id = Submit(CpuSpec(2, 0));  // no restarts allowed at all
  cluster_->Tick();
  StartOn(job_id, 0, "n1");
  StartOn(job_id, 0, "n2");
  ASSERT_THAT(Relay("n1", job_id, 0, 1, {Step(1, 5.0), Step(2, 4.5), CheckpointAt(2), Step(3, 4.0)})
                  .status(),
              IsOk());
  Register("n3", 1);

  auto drained = cluster_->DrainNode("n2", /*checkpoint=*/true, "");
  ASSERT_THAT(drained.status(), IsOk());
  EXPECT_THAT(drained->moving_job_ids(), ElementsAre(job_id));
  for (const std::string node : {"n1", "n2"}) {
    v1::HeartbeatResponse orders = Beat(node, {Task(job_id, 0, node, v1::TASK_STATE_RUNNING)});
    EXPECT_THAT(orders.checkpoint_and_stop(), ElementsAre(absl::StrCat(job_id, "/0/", node)))
        << node;
    EXPECT_TRUE(orders.stop().empty()) << node;
  }
  // The ranks save step 4 and exit; n1's rank 0 reports the checkpoint; a peer's exit seen as a
  // failure on n2 (it stopped first) is recorded but decides nothing.
  ASSERT_THAT(Relay("n1", job_id, 0, 5, {Step(4, 3.8), CheckpointAt(4)}).status(), IsOk());
  v1::TaskStatus peer_gone = Task(job_id, 0, "n2", v1::TASK_STATE_FAILED);
  *peer_gone.mutable_failure() = Failure(v1::FAILURE_KIND_PEER_FAILED, 1, "n2", Now());
  Beat("n2", {peer_gone});
  clock_.Advance(absl::Seconds(10));  // past every settle time
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_RUNNING) << "n1 has not stopped yet";
  Beat("n1", {Task(job_id, 0, "n1", v1::TASK_STATE_STOPPED)});
  cluster_->Tick();

  v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.current_step(), 4) << "resumes from the checkpoint saved for the move";
  ASSERT_THAT(job.attempts(), SizeIs(1));
  EXPECT_THAT(job.attempts(0).reason(), HasSubstr("node n2 drained"));
  EXPECT_FALSE(job.attempts(0).has_failure());
  EXPECT_TRUE(Beat("n2", {}).start().empty()) << "nothing new on the drained node";
  StartOn(job_id, 1, "n1");
  StartOn(job_id, 1, "n3");

  // Removing: only a drained or lost node that holds nothing.
  EXPECT_EQ(cluster_->RemoveNode("n1").code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_THAT(cluster_->DrainNode("n1", false, "").status(), IsOk());
  absl::Status busy = cluster_->RemoveNode("n1");
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(busy.message(), HasSubstr(job_id));
  ASSERT_THAT(cluster_->RemoveNode("n2"), IsOk());
  EXPECT_EQ(cluster_->RemoveNode("n2").code(), absl::StatusCode::kNotFound);
  ClusterStats stats = cluster_->Tick();
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_DRAINING], 1);  // n1
  EXPECT_EQ(stats.nodes[v1::NODE_STATE_READY], 1);     // n3
  EXPECT_TRUE(Beat("n2", {}).reregister()) << "a removed node's worker registers as a new node";
}

// A job cancelled while it moves is not queued again.
TEST_F(ClusterTest, AJobCancelledWhileItMovesStaysCancelled) {
  Register("n1", 2);
  Register("n2", 2);
  const std::string job_id = Submit(CpuSpec(2, 0));
  cluster_->Tick();
  const std::string node = Job(job_id).placements(0).node_id();
  StartOn(job_id, 0, node);
  ASSERT_THAT(cluster_->DrainNode(node, true, "").status(), IsOk());
  ASSERT_THAT(jobs_->Cancel(job_id, "test").status(), IsOk());
  Beat(node, {Task(job_id, 0, node, v1::TASK_STATE_STOPPED)});
  cluster_->Tick();
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(Job(job_id).attempt(), 0);
}

}  // namespace
}  // namespace tessera::coordinator
