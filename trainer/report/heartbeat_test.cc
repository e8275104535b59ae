#include "trainer/report/heartbeat.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/util/wait.h"

namespace tessera::trainer {
namespace {

class RecordingReporter final : public Reporter {
 public:
  absl::Status Send(const v1::TrainerReport& report) override {
    absl::MutexLock lock(&mu_);
    reports_.push_back(report);
    return absl::OkStatus();
  }
  std::vector<v1::TrainerReport> reports() {
    absl::MutexLock lock(&mu_);
    return reports_;
  }
  // Waits (up to 10 s) until at least `count` reports arrived.
  bool WaitFor(size_t count) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return reports_.size() >= count; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::TrainerReport> reports_ ABSL_GUARDED_BY(mu_);
};

TEST(RankProgressTest, HeartbeatCarriesMeansSincePreviousOne) {
  RankProgress progress;
  progress.SetStep(40);  // resumed
  v1::RankHeartbeat idle = progress.TakeHeartbeat();
  EXPECT_EQ(idle.step(), 40);
  EXPECT_EQ(idle.step_seconds(), 0);
  EXPECT_EQ(idle.busy_seconds(), 0);

  progress.StepFinished(41, 2.0, 1.5);
  progress.StepFinished(42, 4.0, 0.5);
  v1::RankHeartbeat first = progress.TakeHeartbeat();
  EXPECT_EQ(first.step(), 42);
  EXPECT_DOUBLE_EQ(first.step_seconds(), 3.0);
  EXPECT_DOUBLE_EQ(first.busy_seconds(), 1.0);

  // The next interval starts empty: a rank between steps reports no step time.
  v1::RankHeartbeat second = progress.TakeHeartbeat();
  EXPECT_EQ(second.step(), 42);
  EXPECT_EQ(second.step_seconds(), 0);
  progress.StepFinished(43, 1.0, 1.0);
  EXPECT_DOUBLE_EQ(progress.TakeHeartbeat().step_seconds(), 1.0);
}

// On simulated time: one heartbeat at once, then one per interval of the clock, stamped with it;
// none between, and none once the sender is gone.
TEST(HeartbeatSenderTest, SendsAtOnceAndThenEveryInterval) {
  RecordingReporter reporter;
  RankProgress progress;
  progress.StepFinished(7, 0.25, 0.2);
  SimulatedClock clock;
  const absl::Time start = clock.Now();
  const absl::Duration interval = absl::Milliseconds(50);
  // The sender's thread is waiting for its next heartbeat (it sent the ones before).
  auto waiting = [&] {
    return ::tessera::testing::WaitUntil([&] { return clock.waiters() == 1; }, absl::Seconds(10));
  };
  {
    HeartbeatSender sender(
        reporter, progress,
        {.job_id = "job-9", .attempt = 2, .rank = 3, .interval = interval, .clock = &clock});
    ASSERT_TRUE(reporter.WaitFor(1));
    for (size_t sent = 1; sent < 4; ++sent) {
      ASSERT_TRUE(waiting());
      EXPECT_EQ(reporter.reports().size(), sent) << "nothing before the interval is over";
      clock.Advance(interval / 2);
      ASSERT_TRUE(waiting());
      EXPECT_EQ(reporter.reports().size(), sent);
      clock.Advance(interval / 2);
      ASSERT_TRUE(reporter.WaitFor(sent + 1));
    }
    ASSERT_TRUE(waiting());
  }
  // Destruction stopped the thread: time goes on and nothing more arrives.
  clock.Advance(10 * interval);
  const std::vector<v1::TrainerReport> reports = reporter.reports();
  ASSERT_EQ(reports.size(), 4u);
  for (size_t i = 0; i < reports.size(); ++i) {
    const v1::TrainerReport& report = reports[i];
    ASSERT_TRUE(report.has_heartbeat());
    EXPECT_EQ(report.job_id(), "job-9");
    EXPECT_EQ(report.attempt(), 2);
    EXPECT_EQ(report.rank(), 3);
    EXPECT_EQ(absl::FromUnixNanos(
                  google::protobuf::util::TimeUtil::TimestampToNanoseconds(report.time())),
              start + static_cast<int64_t>(i) * interval);
    EXPECT_EQ(report.heartbeat().step(), 7);
  }
  EXPECT_DOUBLE_EQ(reports[0].heartbeat().step_seconds(), 0.25);
  EXPECT_DOUBLE_EQ(reports[0].heartbeat().busy_seconds(), 0.2);
  EXPECT_EQ(reports[1].heartbeat().step_seconds(), 0);
}

TEST(HeartbeatIntervalTest, ZeroMeansOneSecond) {
  v1::TrainerTask task;
  EXPECT_EQ(HeartbeatInterval(task), absl::Seconds(1));
  task.set_heartbeat_interval_seconds(0.25);
  EXPECT_EQ(HeartbeatInterval(task), absl::Milliseconds(250));
}

}  // namespace
}  // namespace tessera::trainer
