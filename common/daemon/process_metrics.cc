#include "common/daemon/process_metrics.h"

#include <unistd.h>

#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/daemon/metric_families.h"
#include "common/read_file.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_type.h"

namespace tessera {
namespace {

// Fields of /proc/<pid>/stat (proc(5), counted from 1), as indices into the fields after the
// command name's closing parenthesis, which start at field 3.
constexpr int kUtime = 14 - 3;
constexpr int kStime = 15 - 3;
constexpr int kStartTime = 22 - 3;
constexpr int kVsize = 23 - 3;
constexpr int kRss = 24 - 3;

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type,
                                double value) {
  prometheus::MetricFamily family = NewFamily(name, help, type);
  AddSample(family, {}, value);
  return family;
}

}  // namespace

absl::StatusOr<ProcessSample> ReadProcessSample(const std::string& proc_root,
                                                int64_t ticks_per_second, int64_t page_bytes) {
  if (ticks_per_second <= 0) ticks_per_second = sysconf(_SC_CLK_TCK);
  if (page_bytes <= 0) page_bytes = sysconf(_SC_PAGESIZE);
  const std::string stat_path = proc_root + "/self/stat";
  absl::StatusOr<std::string> stat = ReadWholeFile(stat_path);
  if (!stat.ok()) return stat.status();
  // The command name may hold spaces and parentheses: the fields start after the last ')'.
  const size_t close = stat->rfind(')');
  if (close == std::string::npos) {
    return absl::InternalError(absl::StrCat(stat_path, ": no command name in ", *stat));
  }
  const std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(*stat).substr(close + 1), ' ', absl::SkipWhitespace());
  uint64_t utime = 0, stime = 0, start_ticks = 0, vsize = 0, rss_pages = 0;
  if (fields.size() <= kRss || !absl::SimpleAtoi(fields[kUtime], &utime) ||
      !absl::SimpleAtoi(fields[kStime], &stime) ||
      !absl::SimpleAtoi(fields[kStartTime], &start_ticks) ||
      !absl::SimpleAtoi(fields[kVsize], &vsize) || !absl::SimpleAtoi(fields[kRss], &rss_pages)) {
    return absl::InternalError(absl::StrCat(stat_path, ": cannot parse ", *stat));
  }

  // The boot time, for the start time: the `btime` line of /proc/stat.
  const std::string system_stat_path = proc_root + "/stat";
  absl::StatusOr<std::string> system_stat = ReadWholeFile(system_stat_path);
  if (!system_stat.ok()) return system_stat.status();
  std::optional<int64_t> boot_time;
  for (absl::string_view line : absl::StrSplit(*system_stat, '\n')) {
    int64_t value = 0;
    if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtoi(line, &value)) boot_time = value;
  }
  if (!boot_time) {
    return absl::InternalError(absl::StrCat(system_stat_path, ": no btime line"));
  }

  const std::string fd_path = proc_root + "/self/fd";
  std::error_code error;
  int64_t open_fds = 0;
  for (std::filesystem::directory_iterator it(fd_path, error), end; !error && it != end;
       it.increment(error)) {
    ++open_fds;
  }
  if (error) {
    return absl::InternalError(absl::StrCat(fd_path, ": ", error.message()));
  }

  const double ticks = static_cast<double>(ticks_per_second);
  return ProcessSample{
      .cpu_seconds = static_cast<double>(utime + stime) / ticks,
      .resident_memory_bytes = static_cast<int64_t>(rss_pages) * page_bytes,
      .virtual_memory_bytes = static_cast<int64_t>(vsize),
      // The listing's own descriptor is counted too, as the Go client counts it.
      .open_fds = open_fds,
      .start_time_seconds = static_cast<double>(*boot_time) + start_ticks / ticks,
  };
}

std::vector<prometheus::MetricFamily> ProcessMetrics::Collect() const {
  using prometheus::MetricType;
  absl::StatusOr<ProcessSample> sample = ReadProcessSample(proc_root_);
  if (!sample.ok()) return {};
  std::vector<prometheus::MetricFamily> families;
  families.push_back(Family("process_cpu_seconds_total",
                            "Total user and system CPU time spent in seconds.", MetricType::Counter,
                            sample->cpu_seconds));
  families.push_back(Family("process_resident_memory_bytes", "Resident memory size in bytes.",
                            MetricType::Gauge, static_cast<double>(sample->resident_memory_bytes)));
  families.push_back(Family("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                            MetricType::Gauge, static_cast<double>(sample->virtual_memory_bytes)));
  families.push_back(Family("process_open_fds", "Number of open file descriptors.",
                            MetricType::Gauge, static_cast<double>(sample->open_fds)));
  families.push_back(Family("process_start_time_seconds",
                            "Start time of the process since unix epoch in seconds.",
                            MetricType::Gauge, sample->start_time_seconds));
  return families;
}

}  // namespace tessera
