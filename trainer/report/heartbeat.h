// A trainer rank's heartbeat: a thread of its own sends TrainerReport.heartbeat (RankHeartbeat)
// to the worker every interval, from process start, through setup, checkpoint loads and
// collectives, so a rank whose heartbeats stop is frozen (stopped, wedged in the kernel or a
// driver), not merely slow. Each heartbeat carries the optimizer steps completed and the mean
// wall and busy time of the steps since the previous one (busy = not waiting for peers, see
// trainer/parallel/peer_wait.h), from which the coordinator names stragglers, and the mean of
// their StepTimeBreakdown.
//
// Thread safety: RankProgress is guarded by a mutex (the training loop records, the heartbeat
// thread takes); HeartbeatSender is constructed and destroyed by one thread.
#pragma once

#include <cstdint>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "tessera/v1/trainer.pb.h"
#include "trainer/report/reporter.h"

namespace tessera::trainer {

// TrainerTask.heartbeat_interval_seconds when it is 0.
inline constexpr absl::Duration kDefaultHeartbeatInterval = absl::Seconds(1);

// The task's heartbeat interval (kDefaultHeartbeatInterval when unset or not positive).
absl::Duration HeartbeatInterval(const v1::TrainerTask& task);

// Step times recorded by the training loop, drained by each heartbeat.
class RankProgress {
 public:
  // Steps completed before this process started (a resumed checkpoint's step).
  void SetStep(int64_t step);
  // An optimizer step finished: `step` steps completed in all; it took `wall_seconds`, of which
  // `busy_seconds` were not spent waiting for peers. `breakdown` (may be null: not measured) is
  // where its time went.
  void StepFinished(int64_t step, double wall_seconds, double busy_seconds,
                    const v1::StepTimeBreakdown* breakdown = nullptr);
  // Steps completed, and the means over the steps finished since the previous call (0 when
  // none), the breakdown's among them (over the steps that had one); starts the next interval.
  v1::RankHeartbeat TakeHeartbeat();

 private:
  absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_in_interval_ ABSL_GUARDED_BY(mu_) = 0;
  double wall_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double busy_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t breakdowns_in_interval_ ABSL_GUARDED_BY(mu_) = 0;
  v1::StepTimeBreakdown breakdown_sum_ ABSL_GUARDED_BY(mu_);
};

struct HeartbeatOptions {
  // Identify the sender in each TrainerReport.
  std::string job_id;
  int attempt = 0;
  int rank = 0;
  absl::Duration interval = kDefaultHeartbeatInterval;
  // Paces the heartbeats and stamps their time (must outlive the sender); tests pass a
  // SimulatedClock.
  Clock* clock = Clock::Real();
};

// Sends a heartbeat at once and then every options.interval until destroyed. `reporter` and
// `progress` must outlive it. A heartbeat the reporter cannot deliver is dropped: the worker
// that would read it is gone, and the report socket's watch ends the process.
class HeartbeatSender {
 public:
  HeartbeatSender(Reporter& reporter, RankProgress& progress, HeartbeatOptions options);
  ~HeartbeatSender();
  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

 private:
  void Loop();

  Reporter& reporter_;
  RankProgress& progress_;
  const HeartbeatOptions options_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tessera::trainer
