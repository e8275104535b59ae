// Version and build information every binary reports (`--version`, Prometheus
// tessera_build_info, worker registration).
#pragma once

#include <string>

namespace tessera {

// Semantic version of this build, e.g. "0.1.0".
const char* Version();

// One line for `--version`: version, git commit, build type, CUDA on or off.
std::string BuildSummary();

}  // namespace tessera
