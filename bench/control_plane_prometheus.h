// Reads the coordinator's own Prometheus figures (scheduler pass and SQLite
// write durations, server-side RPC durations) so the benchmark can say where
// the coordinator's time goes, next to what the clients measured.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::bench {

// Default deadline of one scrape.
inline constexpr absl::Duration kScrapeTimeout = absl::Seconds(10);

// One scrape: each sample line's series ("name" or "name{labels}", exactly
// as exposed) to its value.
using MetricSamples = std::map<std::string, double>;

// GET http://127.0.0.1:<port>/metrics, parsed. UNAVAILABLE when nothing
// listens, DEADLINE_EXCEEDED past `timeout`.
absl::StatusOr<MetricSamples> ScrapeMetrics(int port, absl::Duration timeout = kScrapeTimeout);

// Sum and count of one histogram series.
struct HistogramTotals {
  double sum = 0;
  double count = 0;
};

// The totals of histogram `name` with `labels` (e.g. `method="/a.B/C"`, or
// "" for none); zero when the scrape lacks it.
HistogramTotals HistogramIn(const MetricSamples& samples, const std::string& name,
                            const std::string& labels = "");

// What happened between two scrapes of one histogram.
HistogramTotals Difference(const HistogramTotals& after, const HistogramTotals& before);

}  // namespace tessera::bench
