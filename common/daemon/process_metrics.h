// Prometheus's standard process metrics for a daemon, which prometheus-cpp does not provide: what
// Linux says of the process in /proc, read at each scrape:
//   process_cpu_seconds_total       user + system CPU time (counter)
//   process_resident_memory_bytes   resident set size
//   process_virtual_memory_bytes    virtual memory size
//   process_open_fds                open file descriptors
//   process_start_time_seconds      start time, unix seconds
// with the names and meanings of the Go and Python clients, so the usual dashboards work.
//
// Thread safety: Collect may be called from any thread; the object holds no mutable state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"

namespace tessera {

// One reading of a process's figures.
struct ProcessSample {
  double cpu_seconds = 0;
  int64_t resident_memory_bytes = 0;
  int64_t virtual_memory_bytes = 0;
  int64_t open_fds = 0;
  double start_time_seconds = 0;
};

// Reads `proc_root`/self/stat, `proc_root`/self/fd and `proc_root`/stat (for the boot time);
// errors name the file at fault. `ticks_per_second` and `page_bytes` are the system's
// (sysconf(_SC_CLK_TCK), sysconf(_SC_PAGESIZE)) unless a test gives others.
absl::StatusOr<ProcessSample> ReadProcessSample(const std::string& proc_root = "/proc",
                                                int64_t ticks_per_second = 0,
                                                int64_t page_bytes = 0);

// Register with a daemon's exposer (DaemonServers::RegisterCollectable) to serve the families
// above. A failed reading serves no families and logs nothing: /proc is always there on Linux.
class ProcessMetrics final : public prometheus::Collectable {
 public:
  explicit ProcessMetrics(std::string proc_root = "/proc") : proc_root_(std::move(proc_root)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const std::string proc_root_;
};

}  // namespace tessera
