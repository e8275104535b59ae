// SchedulingPass on its own, without Cluster: a ClusterState whose nodes the test registers
// directly, an in-memory store, a simulated clock. Each test runs passes and checks what the
// pipeline left in the store, the ledger and the nodes' queued orders.

#include "coordinator/cluster/scheduling_pass.h"

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "coordinator/cluster/attempt_fate.h"
#include "coordinator/cluster/cluster_state.h"
#include "coordinator/cluster/fair_share_saver.h"
#include "coordinator/cluster/pass_fixture.h"
#include "coordinator/jobs/job_manager.h"
#include "coordinator/store/store_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {
namespace {

using ::tessera::testing::IsOk;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Pair;
using ::testing::SizeIs;

class SchedulingPassTest : public PassFixture {
 protected:
  void SetUp() override {
    PassFixture::SetUp();
    pass_ = std::make_unique<SchedulingPass>(state_.get(), ledger_.get(), nodes_.get(), jobs_.get(),
                                             fate_.get());
  }

  std::unique_ptr<SchedulingPass> pass_;
};

// A pass places a waiting job: the placement is stored (SCHEDULED, with its ranks and master
// port), the devices are held, and the assignment is released to the node once stored.
TEST_F(SchedulingPassTest, PlacesAWaitingJobAndReleasesItsAssignmentOnceStored) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  const ClusterStats stats = pass_->Run(/*count=*/true, /*overlap_store=*/false);

  const v1::Job job = Job(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(job.placements(), SizeIs(2));
  EXPECT_GT(job.master_port(), 0);
  EXPECT_THAT(job.reason(), HasSubstr("placed on n1"));
  bool storing = true;
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_FALSE(storing);
  const v1::HeartbeatResponse orders = Orders("n1");
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).task_id(), TaskId(job_id, 0, "n1"));
  EXPECT_EQ(orders.start(0).trainers(0).assignment().master_port(), job.master_port());

  EXPECT_EQ(stats.jobs.at(v1::JOB_STATE_SCHEDULED), 1);
  EXPECT_EQ(stats.cpu_slots_total, 2);
  EXPECT_EQ(stats.cpu_slots_allocated, 2);
  for (const char* phase : {"list", "settle", "plan", "schedule", "admit", "store", "count"}) {
    EXPECT_TRUE(stats.phase_seconds.contains(phase)) << phase;
  }
}

// Without a queue file, a full cluster: a job of higher priority that cannot be placed preempts a
// lower one of the same (implicit) queue, whose devices let it start; one of equal priority
// preempts nothing. The victim saves a checkpoint and stops, goes back to PENDING with no
// restart counted, and the higher-priority job is placed on its devices.
TEST_F(SchedulingPassTest, AHigherPriorityJobPreemptsALowerOneWhenTheClusterIsFull) {
  Register("n1", 2);
  const std::string low = Submit(2, 0, /*priority=*/0);
  pass_->Run(/*count=*/false, /*overlap_store=*/false);
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_SCHEDULED);
  Orders("n1");
  const std::string peer = Submit(2, 0, /*priority=*/0);
  clock_.Advance(absl::Seconds(1));
  pass_->Run(/*count=*/false, /*overlap_store=*/false);
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_SCHEDULED) << "equal priority preempts nothing";
  EXPECT_EQ(Job(peer).state(), v1::JOB_STATE_PENDING);

  const std::string high = Submit(2, 0, /*priority=*/5);
  clock_.Advance(absl::Seconds(1));
  pass_->Run(/*count=*/false, /*overlap_store=*/false);
  const v1::Job victim = Job(low);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PREEMPTED);
  EXPECT_THAT(victim.reason(),
              HasSubstr("preempted by higher-priority " + high + " (priority 5) in queue"));
  EXPECT_THAT(Job(high).reason(), HasSubstr("waiting for " + low + " to save a checkpoint"));
  EXPECT_EQ(Job(peer).state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Orders("n1").checkpoint_and_stop(), SizeIs(1));
  {
    GuardedLedger::Hold held(ledger_.get());
    held->Find(low)->SetTaskState("n1", v1::TASK_STATE_STOPPED);
  }
  for (int i = 0; i < 3 && Job(high).state() == v1::JOB_STATE_PENDING; ++i) {
    clock_.Advance(absl::Seconds(1));
    pass_->Run(/*count=*/false, /*overlap_store=*/false);
  }
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_SCHEDULED) << Job(high).reason();
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(low).restarts(), 0);
  EXPECT_EQ(Job(peer).state(), v1::JOB_STATE_PENDING);
}

// The spec is resolved once, at submission: the pass plans for the model the submission resolved
// (a from_pretrained config.json is not read again; here it is gone by then), keeps a preset's
// name, and carries the resolved settings into the plan every trainer gets.
TEST_F(SchedulingPassTest, PlansForTheModelResolvedAtSubmission) {
  Register("n1", 4);
  ::tessera::testing::ScopedTempDir dir("pass-pretrained");
  const std::string config = dir.path() + "/config.json";
  std::ofstream(config) << R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": 2,
                               "n_positions": 128, "vocab_size": 257})";
  v1::JobSpec spec = testing::TinyCpuJobSpec("pretrained", 2);
  spec.mutable_model()->set_from_pretrained(dir.path());
  spec.mutable_optimizer()->set_beta1(0.8);
  auto pretrained = jobs_->Submit(spec, "");
  ASSERT_THAT(pretrained.status(), IsOk());
  EXPECT_EQ(pretrained->plan().model().dims().hidden_size(), 64);
  std::filesystem::remove(config);
  const std::string preset = Submit(2);

  pass_->Run(/*count=*/false, /*overlap_store=*/false);
  const v1::Job placed = Job(pretrained->job_id());
  ASSERT_EQ(placed.state(), v1::JOB_STATE_SCHEDULED) << placed.reason();
  // Planned by the layout planner (with estimates), not left with the provisional plan that a
  // failure to resolve the spec again would have kept.
  EXPECT_TRUE(placed.plan().has_memory());
  EXPECT_THAT(placed.plan().explanation(), Not(HasSubstr("Provisional")));
  EXPECT_EQ(placed.plan().model().dims().hidden_size(), 64);
  EXPECT_EQ(placed.plan().model().dims().num_layers(), 2);
  EXPECT_EQ(placed.plan().settings().adam_beta1(), 0.8);
  EXPECT_EQ(placed.plan().settings().seed(), 1234u);
  EXPECT_EQ(placed.plan().precision(), v1::PRECISION_FP32);
  EXPECT_EQ(Job(preset).plan().model().preset(), "tiny-gpt2");
  // What the trainers are sent is that plan.
  const v1::HeartbeatResponse orders = Orders("n1");
  bool sent = false;
  for (const auto& start : orders.start()) {
    if (start.trainers(0).job_id() != placed.job_id()) continue;
    sent = true;
    EXPECT_EQ(start.trainers(0).plan().SerializeAsString(), placed.plan().SerializeAsString());
  }
  EXPECT_TRUE(sent);
}

// A placement the store refuses is taken back: no devices held, nothing delivered, the job still
// PENDING; the next pass places it.
TEST_F(SchedulingPassTest, APlacementThatCannotBeStoredIsTakenBack) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return id == job_id ? absl::UnavailableError("injected") : absl::OkStatus();
  });
  pass_->Run(true, false);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(Allocated(job_id));
  EXPECT_THAT(Orders("n1").start(), SizeIs(0));

  store_->SetWriteFailureInjector(nullptr);
  pass_->Run(true, false);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_THAT(Orders("n1").start(), SizeIs(1));
}

// With the store thread, a pass returns once it handed its placements over: until they are
// stored the devices are held (storing), the job reads PENDING and nothing is delivered.
TEST_F(SchedulingPassTest, TheStoreThreadReleasesAssignmentsOnlyOnceStored) {
  Register("n1", 2);
  const std::string job_id = Submit(2);
  absl::Notification storing_started, release;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    if (id == job_id && !storing_started.HasBeenNotified()) {
      storing_started.Notify();
      release.WaitForNotification();
    }
    return absl::OkStatus();
  });
  pass_->StartStoreThread();
  const ClusterStats stats = pass_->Run(true, /*overlap_store=*/true);
  EXPECT_EQ(stats.jobs.at(v1::JOB_STATE_SCHEDULED), 1) << "counted as placed";
  ASSERT_TRUE(storing_started.WaitForNotificationWithTimeout(absl::Seconds(30)));
  bool storing = false;
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_TRUE(storing);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Orders("n1").start(), SizeIs(0));
  // A pass meanwhile leaves the placement alone: not placed twice, not drained.
  pass_->Run(true, false);
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_TRUE(storing);

  release.Notify();
  pass_->StopStoreThread();  // stores what was handed over first
  store_->SetWriteFailureInjector(nullptr);
  EXPECT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_TRUE(Allocated(job_id, &storing));
  EXPECT_FALSE(storing);
  EXPECT_THAT(Orders("n1").start(), SizeIs(1));
}

// A job that fits nowhere gets its pending reason stored once, not again by every pass.
TEST_F(SchedulingPassTest, APendingReasonIsStoredOnlyWhenItChanges) {
  Register("n1", 1);
  const std::string job_id = Submit(2);
  int writes = 0;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    writes += id == job_id ? 1 : 0;
    return absl::OkStatus();
  });
  pass_->Run(true, false);
  const v1::Job waiting = Job(job_id);
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(waiting.reason().empty());
  EXPECT_EQ(writes, 1);
  pass_->Run(true, false);
  pass_->Run(true, false);
  EXPECT_EQ(writes, 1) << "an unchanged reason is not stored again";
  store_->SetWriteFailureInjector(nullptr);
}

// A failed attempt's end goes through the pass: once the blame grace has passed, the restart is
// stored, the attempt drained and its devices freed once its task ended, and the next attempt
// placed in the same pass. While its end cannot be stored, it keeps its devices.
TEST_F(SchedulingPassTest, AFailedAttemptIsRestartedOnceItsEndIsStored) {
  Register("n1", 2);
  const std::string job_id = Submit(2, /*max_restarts=*/1);
  pass_->Run(true, false);
  ASSERT_EQ(Job(job_id).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_THAT(Orders("n1").start(), SizeIs(1));  // delivered; then the task fails
  {
    GuardedLedger::Hold held(ledger_.get());
    v1::TrainerFailure failure;
    failure.set_kind(v1::FAILURE_KIND_OUT_OF_MEMORY);
    failure.set_rank(0);
    failure.set_node_id("n1");
    fate_->AddFailureLocked(held, job_id, 0, failure);
    held->Find(job_id)->SetTaskState("n1", v1::TASK_STATE_FAILED);
  }
  bool fail = true;
  store_->SetWriteFailureInjector([&](const std::string& id) {
    return fail && id == job_id ? absl::UnavailableError("injected") : absl::OkStatus();
  });
  pass_->Run(true, false);
  EXPECT_EQ(Job(job_id).restarts(), 0);
  ASSERT_TRUE(Allocated(job_id));
  {
    GuardedLedger::Hold held(ledger_.get());
    EXPECT_EQ(held->Find(job_id)->phase(), Allocation::Phase::kFailing);
  }

  fail = false;
  const ClusterStats stats = pass_->Run(true, false);
  store_->SetWriteFailureInjector(nullptr);
  const v1::Job job = Job(job_id);
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_EQ(job.attempt(), 1);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SCHEDULED) << job.reason();
  EXPECT_EQ(stats.restarts.at(v1::FAILURE_KIND_OUT_OF_MEMORY), 1);
  const v1::HeartbeatResponse orders = Orders("n1");
  ASSERT_THAT(orders.start(), SizeIs(1));
  EXPECT_EQ(orders.start(0).task_id(), TaskId(job_id, 1, "n1"));
}

// Two queues of one cohort, 4 CPU slots each: alice's jobs go to nlp, bob's to vision.
constexpr char kLabQueues[] = R"(
cohorts:
  - name: lab
queues:
  - name: nlp
    cohort: lab
    nominal: {cpu_slots: 4}
    default_for: {users: [alice]}
  - name: vision
    cohort: lab
    nominal: {cpu_slots: 4}
    default_for: {users: [bob]}
)";

// A scheduling pass over one 8-slot node "n1" with a queue file, on simulated time.
struct QueuedPass {
  // Reads the queue file at `path` and builds the pass (fatal failures on error).
  void Init(const std::string& path) {
    auto file = QueueFile::Create({.path = path, .clock = &clock});
    ASSERT_THAT(file.status(), IsOk());
    queues = std::move(*file);
    auto opened = Store::Open(":memory:");
    ASSERT_THAT(opened.status(), IsOk());
    store = std::move(*opened);
    jobs = std::make_unique<JobManager>(store.get(), &clock, queues.get());
    ClusterOptions options;
    options.clock = &clock;
    options.queues = queues.get();
    state = std::make_unique<ClusterState>(store.get(), options);
    nodes = std::make_unique<NodeRegistry>(store.get(), options.heartbeat_timeout,
                                           /*write_behind=*/true, &clock, &state->orders);
    fate = std::make_unique<AttemptFate>(state.get(), nodes.get(), jobs.get());
    pass = std::make_unique<SchedulingPass>(state.get(), ledger.get(), nodes.get(), jobs.get(),
                                            fate.get());
    v1::RegisterNodeRequest request;
    request.set_node_id("n1");
    request.set_address("n1:7000");
    request.mutable_resources()->set_cpu_slots(8);
    bool returning = false;
    ASSERT_THAT(nodes->Register(request, &returning), IsOk());
  }

  // A tiny CPU job of `owner` on `slots` slots, routed to the owner's default queue.
  std::string Submit(const std::string& owner, int slots) {
    auto job = jobs->Submit(testing::TinyCpuJobSpec(owner, slots), "", owner);
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? job->job_id() : "";
  }
  v1::Job Get(const std::string& job_id) {
    auto job = jobs->Get(job_id);
    EXPECT_THAT(job.status(), IsOk());
    return job.ok() ? *job : v1::Job();
  }
  // Takes n1's queued orders, as its heartbeat would (starts delivered, stops sent).
  v1::HeartbeatResponse TakeOrders() {
    GuardedLedger::Hold held(ledger.get());
    v1::HeartbeatResponse orders;
    state->orders.TakeOrders("n1", &orders);
    return orders;
  }
  // The job's state changes, in order, from its watch stream.
  std::vector<v1::StateChange> StateChanges(const std::string& job_id) {
    auto events = store->ReadEvents(job_id, 0, 0);
    EXPECT_THAT(events.status(), IsOk());
    std::vector<v1::StateChange> changes;
    for (const auto& event : events.ok() ? *events : std::vector<v1::JobEvent>{}) {
      if (event.has_state_change()) changes.push_back(event.state_change());
    }
    return changes;
  }

  SimulatedClock clock;
  std::unique_ptr<QueueFile> queues;
  std::unique_ptr<Store> store;
  std::unique_ptr<JobManager> jobs;
  std::unique_ptr<ClusterState> state;
  std::unique_ptr<GuardedLedger> ledger = std::make_unique<GuardedLedger>();
  std::unique_ptr<NodeRegistry> nodes;
  std::unique_ptr<AttemptFate> fate;
  std::unique_ptr<SchedulingPass> pass;
};

// With a queue file, a pass admits only what the queues' quotas allow: a job whose queue has used
// its quota waits with the reason, though the node has room, while another queue's job within its
// quota is placed; once the first queue's job ends, the waiting one is placed.
TEST(SchedulingPassQueuesTest, AQueueBeyondItsQuotaWaitsWhileAnotherIsPlaced) {
  ::tessera::testing::ScopedTempDir dir("pass-queues");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << R"(
cohorts:
  - name: lab
queues:
  - name: nlp
    cohort: lab
    nominal: {cpu_slots: 4}
    borrowing_limit: {cpu_slots: 0}
    default_for: {users: [alice]}
  - name: vision
    cohort: lab
    nominal: {cpu_slots: 4}
    default_for: {users: [bob]}
)";
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  SimulatedClock& clock = queued.clock;
  JobManager& jobs = *queued.jobs;
  SchedulingPass& pass = *queued.pass;
  auto submit = [&](const std::string& owner, int slots) { return queued.Submit(owner, slots); };
  auto get = [&](const std::string& job_id) { return queued.Get(job_id); };

  const std::string first = submit("alice", 4);
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  EXPECT_EQ(get(first).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(get(first).queue(), "nlp");

  const std::string second = submit("alice", 2);
  const std::string other = submit("bob", 4);
  clock.Advance(absl::Minutes(1));
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  const v1::Job held = get(second);
  EXPECT_EQ(held.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(held.reason(), HasSubstr("queue nlp: 4 of 4 CPU slots in use, needs 2"));
  EXPECT_EQ(get(other).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(get(other).queue(), "vision");

  // The first job ends: its slots come back to nlp, and the second is placed.
  ASSERT_THAT(jobs.Cancel(first, "done with it").status(), IsOk());
  {
    GuardedLedger::Hold held(queued.ledger.get());
    Allocation* allocation = held->Find(first);
    ASSERT_NE(allocation, nullptr);
    allocation->SetTaskState("n1", v1::TASK_STATE_STOPPED);
  }
  // (Passes without the liveness scan: the test's node sends no heartbeats.)
  for (int i = 0; i < 3 && get(second).state() == v1::JOB_STATE_PENDING; ++i) {
    clock.Advance(absl::Seconds(10));
    pass.Run(/*count=*/false, /*overlap_store=*/false);
  }
  EXPECT_EQ(get(second).state(), v1::JOB_STATE_SCHEDULED) << get(second).reason();
}

// A pending reason whose figures alone change is stored again only after 30 s; one that says
// something else is stored at once.
TEST(SchedulingPassQueuesTest, AReasonWhoseFiguresAloneChangeIsStoredAtMostEvery30s) {
  ::tessera::testing::ScopedTempDir dir("pass-reasons");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << R"(
queues:
  - name: nlp
    nominal: {cpu_slots: 4}
    default_for: {users: [alice]}
)";
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  auto run = [&](absl::Duration after) {
    queued.clock.Advance(after);
    queued.pass->Run(/*count=*/false, /*overlap_store=*/false);
  };
  const std::string first = queued.Submit("alice", 1);
  const std::string second = queued.Submit("alice", 1);
  run(absl::Seconds(1));
  const std::string big = queued.Submit("alice", 4);
  run(absl::Seconds(1));
  EXPECT_THAT(queued.Get(big).reason(), HasSubstr("queue nlp: 2 of 4 CPU slots in use, needs 4"));

  // One of the two ends: the reason's figures change, nothing else.
  ASSERT_THAT(queued.jobs->Cancel(first, "done").status(), IsOk());
  {
    GuardedLedger::Hold held(queued.ledger.get());
    held->Find(first)->SetTaskState("n1", v1::TASK_STATE_STOPPED);
  }
  run(absl::Seconds(1));
  run(absl::Seconds(1));
  EXPECT_THAT(queued.Get(big).reason(), HasSubstr("2 of 4 CPU slots in use"))
      << "not rewritten within 30 s for a figure";
  run(absl::Seconds(30));
  EXPECT_THAT(queued.Get(big).reason(), HasSubstr("queue nlp: 1 of 4 CPU slots in use, needs 4"));

  // A reason of another shape is stored at once.
  std::ofstream(path + ".next") << R"(
queues:
  - name: nlp
    nominal: {cpu_slots: 2}
    default_for: {users: [alice]}
)";
  std::filesystem::rename(path + ".next", path);
  run(absl::Seconds(2));
  EXPECT_THAT(queued.Get(big).reason(), Not(HasSubstr("1 of 4 CPU slots in use")));
  EXPECT_EQ(queued.Get(second).state(), v1::JOB_STATE_SCHEDULED);
}

// A queue whose quota is lent out reclaims it: the borrowing job is asked to save a checkpoint
// and stop, the waiting job says so, and once the victim has stopped it is queued again (no
// restart counted) and the waiting job is placed.
TEST(SchedulingPassQueuesTest, LentQuotaIsReclaimedByCheckpointAndStop) {
  ::tessera::testing::ScopedTempDir dir("pass-preempt");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << kLabQueues;
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  SimulatedClock& clock = queued.clock;
  ClusterState& state = *queued.state;
  SchedulingPass& pass = *queued.pass;
  auto submit = [&](const std::string& owner, int slots) { return queued.Submit(owner, slots); };
  auto get = [&](const std::string& job_id) { return queued.Get(job_id); };
  auto run = [&] {
    clock.Advance(absl::Seconds(10));
    pass.Run(/*count=*/false, /*overlap_store=*/false);
  };

  // vision uses its own 4 slots, then borrows nlp's idle 4.
  const std::string own = submit("bob", 4);
  run();
  const std::string borrowing = submit("bob", 4);
  run();
  ASSERT_EQ(get(own).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(get(borrowing).state(), v1::JOB_STATE_SCHEDULED);
  queued.TakeOrders();  // the two starts, delivered

  // nlp wants its quota back: the borrowing job is asked to checkpoint and stop.
  const std::string reclaiming = submit("alice", 4);
  run();
  v1::Job waiting = get(reclaiming);
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(waiting.reason(), HasSubstr("waiting for " + borrowing +
                                          " to save a checkpoint and stop"));
  const std::string task = TaskId(borrowing, 0, "n1");
  {
    GuardedLedger::Hold held(queued.ledger.get());
    v1::HeartbeatResponse orders;
    state.orders.TakeOrders("n1", &orders);
    ASSERT_THAT(orders.checkpoint_and_stop(), SizeIs(1));
    EXPECT_EQ(orders.checkpoint_and_stop(0), task);
    // The ranks get the queue file's deadline (the default, 120 s), not the worker's grace.
    ASSERT_TRUE(orders.checkpoint_deadline_seconds().contains(task));
    EXPECT_DOUBLE_EQ(orders.checkpoint_deadline_seconds().at(task), 120);
    Allocation* victim = held->Find(borrowing);
    ASSERT_NE(victim, nullptr);
    EXPECT_EQ(victim->phase(), Allocation::Phase::kMoving);
    // Not preempted twice while the victim saves its checkpoint.
    EXPECT_EQ(held->Find(own)->phase(), Allocation::Phase::kRunning);
  }
  v1::Job victim = get(borrowing);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PREEMPTED);
  EXPECT_THAT(victim.reason(), HasSubstr("preempted by " + reclaiming + " of queue nlp"));
  EXPECT_THAT(victim.reason(), HasSubstr("saving a checkpoint (deadline 2m)"));

  // The victim saves a checkpoint 3 s after it was asked, and stops.
  const absl::Time asked = clock.Now();
  clock.Advance(absl::Seconds(3));
  v1::Checkpoint checkpoint;
  checkpoint.set_job_id(borrowing);
  checkpoint.set_step(40);
  checkpoint.set_path(dir.path() + "/step-40");
  *checkpoint.mutable_create_time() = ToProto(asked + absl::Seconds(3));
  ASSERT_THAT(queued.jobs->RecordReports(borrowing, {}, {}, {checkpoint}), IsOk());
  {
    GuardedLedger::Hold held(queued.ledger.get());
    held->Find(borrowing)->SetTaskState("n1", v1::TASK_STATE_STOPPED);
  }
  for (int i = 0; i < 3 && get(reclaiming).state() == v1::JOB_STATE_PENDING; ++i) run();
  EXPECT_EQ(get(reclaiming).state(), v1::JOB_STATE_SCHEDULED) << get(reclaiming).reason();
  victim = get(borrowing);
  // PREEMPTED -> PENDING, waiting for quota again; not a failure, no restart counted.
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(victim.restarts(), 0);
  EXPECT_EQ(victim.current_step(), 40);
  ASSERT_THAT(victim.attempts(), SizeIs(1));
  EXPECT_THAT(victim.attempts(0).reason(), HasSubstr("preempted by " + reclaiming));
  EXPECT_THAT(victim.attempts(0).reason(), HasSubstr("checkpoint step 40 saved in 3.0 s"));
  EXPECT_EQ(get(own).state(), v1::JOB_STATE_SCHEDULED);
  // The watch stream tells the story: SCHEDULED -> PREEMPTED -> PENDING.
  std::vector<v1::JobState> states;
  for (const auto& change : queued.StateChanges(borrowing)) states.push_back(change.new_state());
  EXPECT_THAT(states, ElementsAre(v1::JOB_STATE_PENDING, v1::JOB_STATE_SCHEDULED,
                                  v1::JOB_STATE_PREEMPTED, v1::JOB_STATE_PENDING));
  // Counted by queue and reason for the metrics.
  const ClusterStats stats = pass.Run(/*count=*/false, /*overlap_store=*/false);
  ASSERT_TRUE(stats.queues.contains("vision"));
  EXPECT_THAT(stats.queues.at("vision").preemptions, ElementsAre(Pair("reclaim", 1)));
}

// Of two borrowing jobs of one priority, the one that loses least is preempted: the one whose
// newest checkpoint is 1 s old, though it was placed first, not the one placed later that has
// checkpointed nothing for 10 s.
TEST(SchedulingPassQueuesTest, TheVictimIsTheJobWithTheNewestCheckpointNotTheNewestPlacement) {
  ::tessera::testing::ScopedTempDir dir("pass-victim");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << kLabQueues;
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  auto run = [&] {
    queued.clock.Advance(absl::Seconds(10));
    queued.pass->Run(/*count=*/false, /*overlap_store=*/false);
  };
  const std::string own = queued.Submit("bob", 4);
  run();
  const std::string placed_first = queued.Submit("bob", 2);
  run();
  const std::string placed_later = queued.Submit("bob", 2);
  run();
  ASSERT_EQ(queued.Get(placed_first).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(queued.Get(placed_later).state(), v1::JOB_STATE_SCHEDULED);
  queued.TakeOrders();
  queued.clock.Advance(absl::Seconds(9));
  {
    // What the worker protocol records when placed_first's checkpoint report arrives.
    GuardedLedger::Hold held(queued.ledger.get());
    held->Find(placed_first)->last_checkpoint_time = queued.clock.Now();
  }
  queued.clock.Advance(absl::Seconds(1));
  const std::string reclaiming = queued.Submit("alice", 2);
  queued.pass->Run(/*count=*/false, /*overlap_store=*/false);
  EXPECT_EQ(queued.Get(placed_first).state(), v1::JOB_STATE_PREEMPTED);
  EXPECT_THAT(queued.Get(placed_first).reason(), HasSubstr("preempted by " + reclaiming));
  EXPECT_EQ(queued.Get(placed_later).state(), v1::JOB_STATE_SCHEDULED);
  EXPECT_EQ(queued.Get(own).state(), v1::JOB_STATE_SCHEDULED);
}

// A preempted job whose ranks ignore the order is stopped by the worker at the deadline; its job
// resumes from its last periodic checkpoint and its history says no checkpoint came in time.
TEST(SchedulingPassQueuesTest, APreemptedJobWithoutANewCheckpointSaysSo) {
  ::tessera::testing::ScopedTempDir dir("pass-preempt-late");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << kLabQueues << "preemption: {checkpoint_deadline: 30s}\n";
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  auto run = [&] {
    queued.clock.Advance(absl::Seconds(10));
    queued.pass->Run(/*count=*/false, /*overlap_store=*/false);
  };
  queued.Submit("bob", 4);
  run();
  const std::string borrowing = queued.Submit("bob", 4);
  run();
  ASSERT_EQ(queued.Get(borrowing).state(), v1::JOB_STATE_SCHEDULED);
  queued.TakeOrders();  // the two starts, delivered
  const std::string reclaiming = queued.Submit("alice", 4);
  run();
  EXPECT_EQ(queued.Get(borrowing).state(), v1::JOB_STATE_PREEMPTED);
  {
    GuardedLedger::Hold held(queued.ledger.get());
    v1::HeartbeatResponse orders;
    queued.state->orders.TakeOrders("n1", &orders);
    EXPECT_DOUBLE_EQ(orders.checkpoint_deadline_seconds().at(TaskId(borrowing, 0, "n1")), 30);
    held->Find(borrowing)->SetTaskState("n1", v1::TASK_STATE_STOPPED);
  }
  for (int i = 0; i < 3 && queued.Get(reclaiming).state() == v1::JOB_STATE_PENDING; ++i) run();
  const v1::Job victim = queued.Get(borrowing);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(victim.restarts(), 0);
  ASSERT_THAT(victim.attempts(), SizeIs(1));
  EXPECT_THAT(victim.attempts(0).reason(),
              HasSubstr("no checkpoint of step 0 saved within the deadline (30s): the ranks were "
                        "stopped"));
  // The move to PENDING says where it resumes (its reason is now why it waits).
  std::string requeued;
  for (const auto& change : queued.StateChanges(borrowing)) {
    if (change.previous_state() == v1::JOB_STATE_PREEMPTED) requeued = change.reason();
  }
  EXPECT_THAT(requeued, HasSubstr("waits to be placed again from the start"));
}

// Fair share survives a coordinator restart: a queue that used the whole node before the restart
// still has the higher share after it, its usage decayed over the downtime by the half-life, while
// a queue that used nothing stays at zero. The second SchedulingPass and ClusterState stand for
// the restarted coordinator over the same store (the first one saved on its passes).
TEST(SchedulingPassQueuesTest, FairShareUsageSurvivesARestart) {
  ::tessera::testing::ScopedTempDir dir("pass-fair-share");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << kLabQueues << "fair_share: {half_life: 1h}\n";
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  SimulatedClock& clock = queued.clock;
  auto run = [&](SchedulingPass& pass) {
    return pass.Run(/*count=*/false, /*overlap_store=*/false);
  };

  // vision holds all 8 slots (4 borrowed) for two hours.
  const std::string own = queued.Submit("bob", 4);
  const std::string borrowing = queued.Submit("bob", 4);
  run(*queued.pass);
  ASSERT_EQ(queued.Get(own).state(), v1::JOB_STATE_SCHEDULED);
  ASSERT_EQ(queued.Get(borrowing).state(), v1::JOB_STATE_SCHEDULED);
  ClusterStats before;
  for (int i = 0; i < 12; ++i) {
    clock.Advance(absl::Minutes(10));
    before = run(*queued.pass);
  }
  const double vision_before = before.queues["vision"].fair_share;
  ASSERT_GT(vision_before, 0);
  EXPECT_EQ(before.queues["nlp"].fair_share, 0);

  // The coordinator stops (its passes saved the usage; no Cluster::Stop here) and comes back
  // one half-life later, with nothing allocated: only the decay over the downtime applies.
  queued.pass.reset();
  queued.fate.reset();
  queued.nodes.reset();
  queued.state.reset();
  clock.Advance(absl::Hours(1));
  ClusterOptions options;
  options.clock = &clock;
  options.queues = queued.queues.get();
  ClusterState state(queued.store.get(), options);
  GuardedLedger ledger;
  NodeRegistry nodes(queued.store.get(), options.heartbeat_timeout, /*write_behind=*/true, &clock,
                     &state.orders);
  AttemptFate fate(&state, &nodes, queued.jobs.get());
  SchedulingPass restarted(&state, &ledger, &nodes, queued.jobs.get(), &fate);
  ClusterStats after = run(restarted);
  EXPECT_NEAR(after.queues["vision"].fair_share, vision_before / 2, vision_before * 1e-9);
  EXPECT_EQ(after.queues["nlp"].fair_share, 0);

  // A coordinator without the saved usage would have started vision at zero: the store is what
  // kept it.
  ASSERT_THAT(queued.store->SaveQueueUsage(SavedQueueUsage{}), IsOk());
  SchedulingPass forgetful(&state, &ledger, &nodes, queued.jobs.get(), &fate);
  EXPECT_EQ(run(forgetful).queues["vision"].fair_share, 0);
}

// The usage is saved on the first pass with queues and then at most once every kSaveInterval of
// the cluster's clock, not on every pass; SaveFairShare (the coordinator stopping) saves at once.
TEST(SchedulingPassQueuesTest, FairShareUsageIsSavedPeriodically) {
  ::tessera::testing::ScopedTempDir dir("pass-fair-share-save");
  const std::string path = dir.path() + "/queues.yaml";
  std::ofstream(path) << R"(
queues:
  - name: nlp
    nominal: {cpu_slots: 8}
    default_for: {users: [alice]}
)";
  QueuedPass queued;
  ASSERT_NO_FATAL_FAILURE(queued.Init(path));
  SimulatedClock& clock = queued.clock;
  SchedulingPass& pass = *queued.pass;
  auto saved_as_of = [&]() -> std::optional<absl::Time> {
    absl::StatusOr<std::optional<SavedQueueUsage>> saved = queued.store->LoadQueueUsage();
    EXPECT_THAT(saved.status(), IsOk());
    if (!saved.ok() || !saved->has_value()) return std::nullopt;
    return (*saved)->as_of;
  };

  queued.Submit("alice", 4);
  const absl::Time first = clock.Now();
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  // Nothing held before the first pass: nothing to save yet.
  EXPECT_EQ(saved_as_of(), std::nullopt);

  clock.Advance(absl::Seconds(10));
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  // Not saved again within kSaveInterval of the first save.
  EXPECT_EQ(saved_as_of(), std::nullopt);

  clock.Advance(FairShareSaver::kSaveInterval);
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  EXPECT_EQ(saved_as_of(), first + absl::Seconds(10) + FairShareSaver::kSaveInterval);

  clock.Advance(absl::Seconds(10));
  const absl::Time last = clock.Now();
  pass.Run(/*count=*/false, /*overlap_store=*/false);
  EXPECT_EQ(saved_as_of(), last - absl::Seconds(10));
  pass.SaveFairShare();
  EXPECT_EQ(saved_as_of(), last);
}

// A load that fails (here: the table hidden behind the store's back) is tried again on the next
// restore, and nothing is saved meanwhile, so the saved usage is not overwritten by a fresh start;
// once a load succeeds, the saved usage, decayed to the tracker's last observation, is added to
// what the tracker accrued meanwhile.
TEST(FairShareSaverTest, AFailedLoadIsRetriedAndMergedWithoutOverwritingTheSave) {
  ::tessera::testing::ScopedTempDir dir("fair-share-saver");
  const std::string path = dir.path() + "/coordinator.db";
  absl::StatusOr<std::unique_ptr<Store>> store = Store::Open(path);
  ASSERT_THAT(store.status(), IsOk());
  const absl::Time start = absl::FromUnixSeconds(1'700'000'000);
  SavedQueueUsage saved;
  saved.as_of = start;
  saved.queues["nlp"] = {.gpu_seconds = 1000};
  ASSERT_THAT((*store)->SaveQueueUsage(saved), IsOk());

  RawExec(path, "ALTER TABLE queue_usage RENAME TO queue_usage_hidden");
  FairShareSaver saver(store->get());
  FairShareTracker tracker(absl::Hours(1), start + absl::Hours(1));
  saver.RestoreInto(&tracker);
  EXPECT_FALSE(saver.restored());
  tracker.Accrue(start + absl::Hours(2), {{"nlp", Resources{.gpus = 1}}});
  const double accrued = tracker.Usage("nlp").gpu_seconds;
  ASSERT_GT(accrued, 0);
  saver.MaybeSave(start + absl::Hours(2), tracker);
  saver.Save(tracker);
  RawExec(path, "ALTER TABLE queue_usage_hidden RENAME TO queue_usage");
  absl::StatusOr<std::optional<SavedQueueUsage>> loaded = (*store)->LoadQueueUsage();
  ASSERT_THAT(loaded.status(), IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->as_of, start);  // not overwritten

  saver.RestoreInto(&tracker);
  EXPECT_TRUE(saver.restored());
  EXPECT_EQ(tracker.last_observation(), start + absl::Hours(2));
  // Two half-lives from the save to the tracker's last observation.
  EXPECT_NEAR(tracker.Usage("nlp").gpu_seconds, 1000.0 / 4 + accrued, 1e-9);
  saver.MaybeSave(start + absl::Hours(2), tracker);
  loaded = (*store)->LoadQueueUsage();
  ASSERT_THAT(loaded.status(), IsOk());
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->as_of, start + absl::Hours(2));
  EXPECT_NEAR((*loaded)->queues["nlp"].gpu_seconds, 1000.0 / 4 + accrued, 1e-9);
}

}  // namespace
}  // namespace tessera::coordinator
