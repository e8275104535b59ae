// Test-only fakes for running WorkerAgent in-process on simulated time (worker_agent_sim_test.cc,
// worker_failover_test.cc): a clock that tells when every waiting thread has settled, and fake
// trainer ranks (a TrainerLauncher) that exit, ignore SIGTERM or save a checkpoint as a test says.
//
// Thread safety: every class here may be used from any thread.
#pragma once

#include <csignal>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/trainer_env.h"
#include "worker/trainer_launcher.h"

namespace tessera::worker::agent_test {

// Fake pids lie above the kernel's PID_MAX_LIMIT: no pid file is written and no real process is
// ever named.
constexpr pid_t kFakePidBase = 1 << 23;

// A SimulatedClock that also keeps the deadline of every thread waiting on it, so that a test
// can wait until each of those threads waits for a deadline still ahead: whatever the current
// time asked of them is done.
class SteppedClock final : public Clock {
 public:
  absl::Time Now() const override { return clock_.Now(); }
  void SleepUntil(absl::Time deadline) override {
    const int id = Park(deadline);
    clock_.SleepUntil(deadline);
    Unpark(id);
  }
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override {
    const int id = Park(deadline);
    const bool held = clock_.AwaitWithDeadline(mu, condition, deadline);
    Unpark(id);
    return held;
  }
  // Only the test's thread moves time.
  void Advance(absl::Duration duration) { clock_.Advance(duration); }

  // Waits, up to `timeout` of real time, until exactly `threads` threads wait on deadlines after
  // Now(); false on timeout.
  bool Settle(int threads, absl::Duration timeout) {
    const absl::Time now = clock_.Now();
    absl::MutexLock lock(&mu_);
    auto parked = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (static_cast<int>(deadlines_.size()) != threads) return false;
      for (const auto& [id, deadline] : deadlines_) {
        if (deadline <= now) return false;
      }
      return true;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&parked), timeout);
  }

 private:
  int Park(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    deadlines_[next_id_] = deadline;
    return next_id_++;
  }
  void Unpark(int id) {
    absl::MutexLock lock(&mu_);
    deadlines_.erase(id);
  }

  SimulatedClock clock_;
  absl::Mutex mu_;
  int next_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, absl::Time> deadlines_ ABSL_GUARDED_BY(mu_);
};

// How a fake rank answers the worker.
struct Behaviour {
  // SIGTERM does nothing: only the SIGKILL after the stop grace ends it.
  bool ignore_sigterm = false;
  // kCheckpointAndStopSignal makes it exit 0 at once (the save took no time); else ignored.
  bool exit_on_checkpoint = false;
};

// What the worker did to a fake rank, and when (simulated time).
struct Event {
  std::string what;  // "SIGTERM", "SIGKILL" or "signal <n>"
  absl::Time at;
};

// One fake rank: its exit status, and the signals the worker sent it. Thread-safe.
class FakeRank {
 public:
  FakeRank(int rank, pid_t pid, Behaviour behaviour, Clock* clock)
      : rank_(rank), pid_(pid), behaviour_(behaviour), clock_(clock), launched_(clock->Now()) {}

  int rank() const { return rank_; }
  pid_t pid() const { return pid_; }
  absl::Time launched() const { return launched_; }

  // The rank exits by itself with `code` (a no-op once it has exited).
  void Exit(int code) {
    absl::MutexLock lock(&mu_);
    if (!exit_) exit_ = ExitStatus{.exit_code = code, .signal = 0};
  }
  std::vector<Event> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  std::optional<absl::Duration> stop_grace() {
    absl::MutexLock lock(&mu_);
    return stop_grace_;
  }

  std::optional<ExitStatus> Poll() {
    absl::MutexLock lock(&mu_);
    return exit_;
  }
  ExitStatus Stop(absl::Duration grace) {
    absl::MutexLock lock(&mu_);
    if (exit_) return *exit_;
    stop_grace_ = grace;
    events_.push_back({"SIGTERM", clock_->Now()});
    if (!behaviour_.ignore_sigterm) {
      exit_ = ExitStatus{.exit_code = -1, .signal = SIGTERM};
      return *exit_;
    }
    auto exited = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return exit_.has_value(); };
    clock_->AwaitWithDeadline(&mu_, absl::Condition(&exited), clock_->Now() + grace);
    return KillLocked();
  }
  void Signal(int signal) {
    absl::MutexLock lock(&mu_);
    if (exit_) return;
    events_.push_back({absl::StrCat("signal ", signal), clock_->Now()});
    if (signal == kCheckpointAndStopSignal && behaviour_.exit_on_checkpoint) {
      exit_ = ExitStatus{.exit_code = 0, .signal = 0};
    }
  }
  ExitStatus Kill() {
    absl::MutexLock lock(&mu_);
    return KillLocked();
  }

 private:
  ExitStatus KillLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (exit_) return *exit_;
    events_.push_back({"SIGKILL", clock_->Now()});
    exit_ = ExitStatus{.exit_code = -1, .signal = SIGKILL};
    return *exit_;
  }

  const int rank_;
  const pid_t pid_;
  const Behaviour behaviour_;
  Clock* const clock_;
  const absl::Time launched_;
  absl::Mutex mu_;
  std::optional<ExitStatus> exit_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Duration> stop_grace_ ABSL_GUARDED_BY(mu_);
};

// The worker's handle on a FakeRank; the rank outlives it, for the test to inspect.
class FakeTrainer final : public TrainerHandle {
 public:
  explicit FakeTrainer(std::shared_ptr<FakeRank> rank) : rank_(std::move(rank)) {}
  pid_t pid() const override { return rank_->pid(); }
  std::optional<ExitStatus> Poll() override { return rank_->Poll(); }
  ExitStatus Stop(absl::Duration grace) override { return rank_->Stop(grace); }
  void Signal(int signal) override { rank_->Signal(signal); }
  ExitStatus Kill() override { return rank_->Kill(); }
  std::string LogTail(int) const override {
    return absl::StrCat("log of fake rank ", rank_->rank());
  }

 private:
  const std::shared_ptr<FakeRank> rank_;
};

// Launches FakeRanks, each with the behaviour set for its RANK. Thread-safe.
class FakeLauncher final : public TrainerLauncher {
 public:
  explicit FakeLauncher(Clock* clock) : clock_(clock) {}

  void Behave(int rank, Behaviour behaviour) {
    absl::MutexLock lock(&mu_);
    behaviours_[rank] = behaviour;
  }

  absl::StatusOr<std::unique_ptr<TrainerHandle>> Launch(const LaunchSpec& spec) override {
    absl::MutexLock lock(&mu_);
    const int rank = std::stoi(spec.env.at(kRankEnv));
    auto launched = std::make_shared<FakeRank>(
        rank, kFakePidBase + static_cast<pid_t>(ranks_.size()), behaviours_[rank], clock_);
    ranks_.push_back(launched);
    return std::make_unique<FakeTrainer>(std::move(launched));
  }

  // In launch order.
  std::vector<std::shared_ptr<FakeRank>> ranks() {
    absl::MutexLock lock(&mu_);
    return ranks_;
  }
  // Every rank still running exits 0 (before the agent stops: its Stop would wait for the stop
  // grace on a clock nobody moves).
  void ExitAll() {
    for (const auto& rank : ranks()) rank->Exit(0);
  }

 private:
  Clock* const clock_;
  absl::Mutex mu_;
  std::map<int, Behaviour> behaviours_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<FakeRank>> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::worker::agent_test
