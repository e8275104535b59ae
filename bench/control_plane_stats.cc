#include "bench/control_plane_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace tessera::bench {
namespace {

// Nearest-rank percentile of sorted, non-empty `values`; q in (0, 1].
double Percentile(const std::vector<double>& sorted, double q) {
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace

LatencySummary Summarize(std::vector<double>& seconds) {
  LatencySummary summary;
  if (seconds.empty()) return summary;
  std::sort(seconds.begin(), seconds.end());
  summary.count = static_cast<int64_t>(seconds.size());
  summary.p50 = Percentile(seconds, 0.50);
  summary.p99 = Percentile(seconds, 0.99);
  summary.min = seconds.front();
  summary.max = seconds.back();
  summary.mean =
      std::accumulate(seconds.begin(), seconds.end(), 0.0) / static_cast<double>(seconds.size());
  return summary;
}

Spread SpreadOf(std::vector<double> values) {
  Spread spread;
  if (values.empty()) return spread;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  spread.median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  spread.min = values.front();
  spread.max = values.back();
  return spread;
}

void LatencyRecorder::Record(Clock::time_point at, double seconds) {
  absl::MutexLock lock(&mu_);
  samples_.push_back({at, seconds});
}

std::vector<double> LatencyRecorder::Between(Clock::time_point begin, Clock::time_point end) const {
  absl::MutexLock lock(&mu_);
  std::vector<double> seconds;
  for (const LatencySample& sample : samples_) {
    if (sample.at >= begin && sample.at < end) seconds.push_back(sample.seconds);
  }
  return seconds;
}

int64_t LatencyRecorder::CountBetween(Clock::time_point begin, Clock::time_point end) const {
  absl::MutexLock lock(&mu_);
  return std::count_if(samples_.begin(), samples_.end(), [&](const LatencySample& sample) {
    return sample.at >= begin && sample.at < end;
  });
}

}  // namespace tessera::bench
