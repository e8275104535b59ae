// The coordinator under test as a child process of the benchmark, and what
// /proc says about a process's CPU time and memory. The coordinator runs on
// 127.0.0.1 with both ports picked by the kernel; its log goes to a file in
// its state directory so a full pipe can never stall it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera::bench {

// How long the coordinator may take to print its "serving gRPC on" line.
inline constexpr absl::Duration kCoordinatorStartTimeout = absl::Seconds(30);
// How long it may take to exit after SIGTERM before it gets SIGKILL.
inline constexpr absl::Duration kCoordinatorStopTimeout = absl::Seconds(15);

struct CoordinatorProcessOptions {
  // Path of tessera-coordinator.
  std::string binary;
  // Holds the log (and the SQLite state file when `state` is empty); must exist.
  std::string dir;
  // Passed as --state: a postgresql:// URL (no password in it); empty: <dir>/state.db.
  std::string state;
  // Passed as --database_password_file unless empty.
  std::string database_password_file;
  // Passed as --heartbeat_timeout.
  absl::Duration heartbeat_timeout = absl::Seconds(15);
  // Passed as --queue_file unless empty.
  std::string queue_file;
};

// Thread safety: one thread.
class CoordinatorProcess {
 public:
  // Starts the binary and waits until it serves; UNAVAILABLE with its log
  // when it exits or stays silent for kCoordinatorStartTimeout.
  static absl::StatusOr<std::unique_ptr<CoordinatorProcess>> Start(
      const CoordinatorProcessOptions& options);
  // Stops it (SIGTERM, then SIGKILL) if Stop() was not called.
  ~CoordinatorProcess();
  CoordinatorProcess(const CoordinatorProcess&) = delete;
  CoordinatorProcess& operator=(const CoordinatorProcess&) = delete;

  pid_t pid() const { return pid_; }
  // host:port of its gRPC server.
  const std::string& address() const { return address_; }
  // Port of its Prometheus endpoint.
  int metrics_port() const { return metrics_port_; }
  const std::string& log_path() const { return log_path_; }

  // SIGTERM, then SIGKILL after kCoordinatorStopTimeout. DEADLINE_EXCEEDED
  // when it had to be killed. Idempotent.
  absl::Status Stop();

 private:
  CoordinatorProcess(pid_t pid, std::string log_path) : pid_(pid), log_path_(std::move(log_path)) {}

  pid_t pid_;
  std::string log_path_;
  std::string address_;
  int metrics_port_ = 0;
};

// CPU time and memory of one process at one moment.
struct ProcessSample {
  // utime + stime, in seconds.
  double cpu_seconds = 0;
  // VmRSS and VmHWM (peak RSS), in bytes.
  int64_t rss_bytes = 0;
  int64_t peak_rss_bytes = 0;
  int threads = 0;
  // It has exited and waits to be reaped (state Z): the sample's figures are not a live one's.
  bool exited = false;
};

// Reads /proc/<pid>/stat and /proc/<pid>/status; pid 0 reads /proc/self.
absl::StatusOr<ProcessSample> SampleProcess(pid_t pid);

// CPU time every process on the machine has used since boot (the "cpu" line
// of /proc/stat, without idle and iowait), in seconds. The difference over a
// window, less ours, is what other work (e.g. a build) took from the cores.
absl::StatusOr<double> MachineBusySeconds();

}  // namespace tessera::bench
