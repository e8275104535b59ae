// Starting and stopping a Tessera daemon binary as a child process: used by `tessera local` and by
// the control-plane benchmark. The daemons print "serving gRPC on HOST:PORT[, metrics on port N]"
// on stderr once they serve.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

struct ServingDaemon {
  pid_t pid = -1;
  // host:port of its gRPC server.
  std::string address;
  // Its Prometheus port; 0 when it printed none.
  int metrics_port = 0;
};

// Spawns `argv` in its own process group (a terminal's Ctrl-C reaches only the caller, which stops
// it), stdout to /dev/null and stderr to `log_path`, and waits until the log says it serves.
// NOT_FOUND when it cannot be started; UNAVAILABLE, with the log, when it exits first or stays
// silent for `timeout` (it is then stopped).
absl::StatusOr<ServingDaemon> StartDaemon(const std::vector<std::string>& argv,
                                          const std::string& log_path, absl::Duration timeout);

// SIGTERM, then SIGKILL after `timeout`; reaps it. Returns false when it had to be killed.
bool StopDaemon(pid_t pid, absl::Duration timeout);

}  // namespace tessera
