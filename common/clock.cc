#include "common/clock.h"

#include "absl/time/clock.h"

namespace tessera {
namespace {

// How often a waiter on a condition under a simulated clock looks at that clock again. The
// condition itself wakes it at once through its mutex; only a deadline reached by Advance() is
// seen this late (real time), which tests never measure.
constexpr absl::Duration kSimulatedDeadlinePoll = absl::Milliseconds(1);

class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  void SleepUntil(absl::Time deadline) override { absl::SleepFor(deadline - absl::Now()); }
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) override {
    return mu->AwaitWithDeadline(condition, deadline);
  }
};

}  // namespace

Clock* Clock::Real() {
  static Clock* const clock = new RealClock();
  return clock;
}

SimulatedClock::SimulatedClock() : SimulatedClock(absl::FromUnixSeconds(1893456000)) {}

SimulatedClock::SimulatedClock(absl::Time start) : now_(start) {}

absl::Time SimulatedClock::Now() const {
  absl::MutexLock lock(&mu_);
  return now_;
}

void SimulatedClock::SleepUntil(absl::Time deadline) {
  struct Sleeper {
    const absl::Time* now;
    absl::Time deadline;
  };
  Sleeper sleeper{&now_, deadline};
  absl::MutexLock lock(&mu_);
  ++waiters_;
  mu_.Await(absl::Condition(+[](Sleeper* s) { return *s->now >= s->deadline; }, &sleeper));
  --waiters_;
}

bool SimulatedClock::AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                                       absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    ++waiters_;
  }
  bool held = false;
  while (true) {
    if (condition.Eval()) {
      held = true;
      break;
    }
    if (Now() >= deadline) break;
    mu->AwaitWithTimeout(condition, kSimulatedDeadlinePoll);
  }
  absl::MutexLock lock(&mu_);
  --waiters_;
  return held;
}

void SimulatedClock::Advance(absl::Duration duration) {
  if (duration <= absl::ZeroDuration()) return;
  absl::MutexLock lock(&mu_);
  now_ += duration;
}

void SimulatedClock::AdvanceTo(absl::Time time) {
  absl::MutexLock lock(&mu_);
  if (time > now_) now_ = time;
}

int SimulatedClock::waiters() const {
  absl::MutexLock lock(&mu_);
  return waiters_;
}

}  // namespace tessera
