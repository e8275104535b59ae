// The control-plane benchmark's output: a table for people on stdout and
// control-plane.json for scripts/bench.sh's collection, both from the same
// per-scale results.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/control_plane_scale.h"

namespace tessera::bench {

// Where and from what a run came (scripts/bench.sh's contract).
struct RunInfo {
  std::string commit;
  std::string date;
  std::string machine;
  // Where the coordinator's SQLite file lived, e.g. "/tmp (ext4)": its fsync
  // cost shapes every write figure.
  std::string state_filesystem;
};

// The readable summary: one row per scale, then what the coordinator's own
// metrics say and anything that went wrong.
std::string FormatSummary(const RunInfo& info, const ScaleOptions& parameters,
                          const std::vector<ScaleResult>& results);

// Writes `path` (the directory must exist) with every figure, the
// parameters and the run info.
absl::Status WriteJson(const std::string& path, const RunInfo& info, const ScaleOptions& parameters,
                       const std::vector<ScaleResult>& results);

}  // namespace tessera::bench
