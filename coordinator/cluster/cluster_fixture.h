// ClusterTest: the fixture of Cluster's in-process tests (cluster_test.cc: workers, attempts,
// nodes; cluster_pass_test.cc: placements, the loop, the lock): an in-memory store (or one on a
// file, for the loop), one SimulatedClock for the cluster and the job manager, and workers played
// by the test through Register / Heartbeat / Report. No processes, no sleeps: the loop (StartLoop)
// paces itself on the simulated clock, which the waits move on.
//
// Thread safety: a gtest fixture, used from the test's thread, except that the loop's observer
// (StartLoop) counts passes under passes_mu_ for the waits (AwaitPasses, AwaitAfterPasses).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/status_matchers.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/nodes/assignment_notifier.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/job_specs.h"
#include "tests/util/temp_dir.h"

namespace tessera::coordinator {

inline google::protobuf::Timestamp At(absl::Time time) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(time));
}

inline v1::JobSpec CpuSpec(int slots, int max_restarts) {
  return ::tessera::testing::TinyCpuJobSpec("restartable", slots, max_restarts);
}

inline v1::TrainerFailure Failure(v1::FailureKind kind, int rank, const std::string& node,
                                  absl::Time time, const std::string& message = "") {
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
    ASSERT_THAT(store.status(), ::tessera::testing::IsOk());
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
    ASSERT_THAT(cluster_->Register(request).status(), ::tessera::testing::IsOk());
  }

  std::string Submit(const v1::JobSpec& spec) {
    auto job = jobs_->Submit(spec, "");
    EXPECT_THAT(job.status(), ::tessera::testing::IsOk());
    return job.ok() ? job->job_id() : "";
  }

  // A heartbeat from `node` with the given task states; returns the orders it gets back.
  v1::HeartbeatResponse Beat(const std::string& node, const std::vector<v1::TaskStatus>& tasks) {
    v1::HeartbeatRequest request;
    request.set_node_id(node);
    for (const auto& task : tasks) *request.add_tasks() = task;
    auto response = cluster_->Heartbeat(request);
    EXPECT_THAT(response.status(), ::tessera::testing::IsOk());
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
    EXPECT_THAT(job.status(), ::tessera::testing::IsOk());
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
    ASSERT_THAT(orders.start(), ::testing::SizeIs(1));
    EXPECT_EQ(orders.start(0).task_id(), absl::StrCat(job_id, "/", attempt, "/", node));
    Beat(node, {Task(job_id, attempt, node, v1::TASK_STATE_RUNNING)});
  }

  std::vector<v1::JobEvent> Events(const std::string& job_id) {
    auto events = jobs_->Events(job_id, 0, 0);
    EXPECT_THAT(events.status(), ::tessera::testing::IsOk());
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
    ASSERT_THAT(store.status(), ::tessera::testing::IsOk());
    store_ = std::move(*store);
    jobs_ = std::make_unique<JobManager>(store_.get(), &clock_);
    ClusterOptions options;
    options.tick_interval = absl::Milliseconds(10);
    options.min_tick_gap = absl::ZeroDuration();
    options.clock = &clock_;
    loop_tick_ = options.tick_interval;
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
  // Waits (at most `timeout` of real time) until the loop has made `passes` passes in all. The
  // loop paces itself on the simulated clock: whenever it waits for its next tick, time moves on
  // by one tick_interval.
  bool AwaitPasses(int passes, absl::Duration timeout = absl::Seconds(30)) {
    const absl::Time give_up = absl::Now() + timeout;
    absl::MutexLock lock(&passes_mu_);
    const auto reached = [this, passes]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(passes_mu_) {
      return passes_ >= passes;
    };
    while (!reached()) {
      if (absl::Now() >= give_up) return false;
      if (clock_.waiters() > 0) clock_.Advance(loop_tick_);
      passes_mu_.AwaitWithTimeout(absl::Condition(&reached), absl::Milliseconds(1));
    }
    return true;
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
  // The loop's tick_interval (ClusterOptions), by which AwaitPasses moves the clock.
  absl::Duration loop_tick_ = ClusterOptions().tick_interval;
  absl::Mutex passes_mu_;
  int passes_ ABSL_GUARDED_BY(passes_mu_) = 0;
  std::optional<::tessera::testing::ScopedTempDir> dir_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<JobManager> jobs_;
  std::unique_ptr<Cluster> cluster_;
};

}  // namespace tessera::coordinator
