// Latency samples and their summaries for the control-plane benchmark: a
// thread-safe recorder of (when, how long) pairs, so one run can be cut into
// sub-windows afterwards, and percentiles over a slice of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace tessera::bench {

// Every timestamp of the benchmark: monotonic, unaffected by clock steps.
using Clock = std::chrono::steady_clock;

// Seconds from `from` to `to`.
inline double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

struct LatencySample {
  // When the call finished.
  Clock::time_point at;
  double seconds = 0;
};

// Percentiles of a set of durations, in seconds; all zero when count is 0.
struct LatencySummary {
  int64_t count = 0;
  double p50 = 0;
  double p99 = 0;
  double min = 0;
  double max = 0;
  double mean = 0;
};

// Nearest-rank percentiles of `seconds` (sorted in place).
LatencySummary Summarize(std::vector<double>& seconds);

// Median, min and max of a set of per-window figures; all zero when empty.
struct Spread {
  double median = 0;
  double min = 0;
  double max = 0;
};
Spread SpreadOf(std::vector<double> values);

// Thread safety: Record from any thread; the readers copy under the lock.
class LatencyRecorder {
 public:
  void Record(Clock::time_point at, double seconds) ABSL_LOCKS_EXCLUDED(mu_);
  // Durations of the samples whose `at` lies in [begin, end).
  std::vector<double> Between(Clock::time_point begin, Clock::time_point end) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Samples whose `at` lies in [begin, end).
  int64_t CountBetween(Clock::time_point begin, Clock::time_point end) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::vector<LatencySample> samples_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera::bench
