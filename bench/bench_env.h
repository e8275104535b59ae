// What every benchmark records about where it ran, read from the environment
// scripts/bench.sh sets (TESSERA_BENCH_COMMIT, _DATE, _MACHINE, _RESULTS), with
// fallbacks so a benchmark binary also runs by hand.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace tessera::bench {

struct Provenance {
  // Git commit of the tree ("-dirty" when modified); unset: the commit the
  // binary was built from, marked "(at build time)".
  std::string commit;
  // UTC date and time of the run, ISO 8601; unset: now.
  std::string date;
  // CPU model, cores, memory, GPUs; unset: read from /proc (GPUs not probed).
  std::string machine;
};

Provenance ReadProvenance();

// Directory for the benchmark's JSON: $TESSERA_BENCH_RESULTS, else `fallback`.
std::string ResultsDir(const std::string& fallback);

// The folder `results` beside this executable (where a hand run's JSON goes by default), or
// "results" when /proc/self/exe cannot be read.
std::string ResultsBesideExecutable();

// Writes `text` to `dir`/`file_name`, creating `dir`, and says where on stdout. INTERNAL naming
// the path when it cannot.
absl::Status WriteResultsFile(const std::string& dir, const std::string& file_name,
                              const std::string& text);

// The environment variable `name`, or `fallback` when unset or empty.
std::string EnvOr(const char* name, const std::string& fallback);

}  // namespace tessera::bench
