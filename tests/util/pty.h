// Runs a command on a pseudo-terminal of a given size, as a person at a terminal would see it:
// for tests of what the CLI draws (live lines redrawn with \r, fitted to the width).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/util/subprocess.h"

namespace tessera::testing {

struct PtyRun {
  // Everything written to the terminal, bytes as sent (the terminal turns "\n" into "\r\n").
  std::string output;
  ExitInfo exit;
};

// Starts `argv[0]` (a path) with `argv` on a new pseudo-terminal of `columns` x `rows` (stdin,
// stdout and stderr), `extra_env` (NAME=VALUE) added to the environment, and reads until it exits.
// DEADLINE_EXCEEDED (the process is killed) after `timeout`.
absl::StatusOr<PtyRun> RunInPty(const std::vector<std::string>& argv,
                                const std::vector<std::string>& extra_env, int columns, int rows,
                                absl::Duration timeout);

// The terminal lines `output` leaves on screen and in scrollback, each piece between carriage
// returns and newlines, with escape sequences (ESC [ ... letter) removed.
std::vector<std::string> TerminalPieces(const std::string& output);

}  // namespace tessera::testing
