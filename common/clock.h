// Clock: the one source of time for code whose behaviour depends on it (liveness timeouts,
// restart back-off, watchdogs, retry periods). Production code takes a `Clock*` (default
// Clock::Real()); tests pass a SimulatedClock and move time forward themselves instead of
// sleeping, in the spirit of Envoy's TimeSource and Abseil's simulated clocks.
//
// Thread safety: every method may be called from any thread. Clock::Real() lives forever.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tessera {

class Clock {
 public:
  virtual ~Clock() = default;

  virtual absl::Time Now() const = 0;

  // Returns once Now() >= deadline.
  virtual void SleepUntil(absl::Time deadline) = 0;
  void SleepFor(absl::Duration duration) { SleepUntil(Now() + duration); }

  // With `mu` held: waits until `condition` holds (true) or Now() >= deadline (false, unless the
  // condition holds by then). `mu` is released while waiting, as absl::Mutex::AwaitWithDeadline.
  virtual bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                                 absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // The wall clock (absl::Now()).
  static Clock* Real();
};

// A clock that moves only when told to. Sleepers and waiters on it wake when Advance() or
// AdvanceTo() reaches their deadline; waiters on a condition also wake when it holds.
class SimulatedClock final : public Clock {
 public:
  // Starts at a fixed, recognisable time (2030-01-01 UTC), so nothing depends on the real date.
  SimulatedClock();
  explicit SimulatedClock(absl::Time start);

  absl::Time Now() const override;
  void SleepUntil(absl::Time deadline) override;
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override;

  // Moves time forward; a negative duration or an earlier time is ignored (time never goes back).
  void Advance(absl::Duration duration);
  void AdvanceTo(absl::Time time);

  // Threads blocked in SleepUntil() or AwaitWithDeadline() right now; tests wait for a thread to
  // reach its wait before advancing past its deadline.
  int waiters() const;

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  int waiters_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera
