#include "common/daemon/daemon_main.h"

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "common/command_line.h"
#include "common/daemon/log_format.h"
#include "common/daemon/shutdown_signal.h"

ABSL_FLAG(std::string, log_format, "text",
          "text: plain lines; json: one JSON object per line (time, component, pid, message; "
          "gRPC's lines with severity and source) for cluster log collectors.");

namespace tessera {

int StartDaemonProcess(int argc, char** argv, const char* usage, const char* component) {
  BlockShutdownSignals();
  ParseCommandLine(argc, argv, usage);
  auto log_format = ParseLogFormat(absl::GetFlag(FLAGS_log_format));
  if (!log_format.ok()) {
    std::cerr << "tessera-" << component << ": " << log_format.status().message() << "\n";
    return 2;
  }
  InstallLogFormat(*log_format, component);
  return 0;
}

}  // namespace tessera
