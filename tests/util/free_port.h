// Loopback TCP ports for tests that hand a port to a process they start (a TCPStore's
// MASTER_PORT): fixed port numbers collide with concurrent tests and with the kernel's ephemeral
// range, so ask the kernel for one that is free now.
#pragma once

#include "absl/status/statusor.h"

namespace tessera::testing {

// A port on 127.0.0.1 that nothing listens on: bound with port 0 and closed again. The kernel
// hands out ephemeral ports in turn, so it is not given to another socket soon after.
absl::StatusOr<int> PickFreePort();

}  // namespace tessera::testing
