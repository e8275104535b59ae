// The first lines of every Tessera daemon's main(), in one place: SIGINT and SIGTERM blocked
// before any thread starts (shutdown_signal.h), the command line parsed (command_line.h, with
// --help, --helpfull and --version) and the --log_format flag, defined here once for every
// daemon, installed for `component` (log_format.h). The daemon's own flags are read after it;
// its body ends with ServeUntilSignal (daemon_servers.h).
//
//   int main(int argc, char** argv) {
//     if (int code = tessera::StartDaemonProcess(argc, argv, kUsage, "worker"); code != 0) {
//       return code;
//     }
//     ...
//
// Thread safety: call once, first in main(), before any other thread starts.
#pragma once

namespace tessera {

// Returns 0, or the exit code for an unusable command line (2, the error printed to stderr).
int StartDaemonProcess(int argc, char** argv, const char* usage, const char* component);

}  // namespace tessera
