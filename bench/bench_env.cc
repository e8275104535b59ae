#include "bench/bench_env.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/version.h"

namespace tessera::bench {
namespace {

// The machine line scripts/bench.sh would give, without the GPU probe.
std::string DescribeMachine() {
  std::string cpu = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  }
  const double memory_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                            static_cast<double>(sysconf(_SC_PAGESIZE)) / (1024.0 * 1024 * 1024);
  return absl::StrFormat("%s, %d cores, %.0f GiB RAM, GPUs: not probed", cpu,
                         sysconf(_SC_NPROCESSORS_ONLN), memory_gib);
}

// The commit this binary was built from.
std::string BuildCommit() {
  std::smatch match;
  const std::string summary = BuildSummary();
  if (std::regex_search(summary, match, std::regex(R"(commit ([^,]+),)"))) {
    return absl::StrCat(match[1].str(), " (at build time)");
  }
  return "unknown";
}

}  // namespace

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

Provenance ReadProvenance() {
  Provenance p;
  p.commit = EnvOr("TESSERA_BENCH_COMMIT", BuildCommit());
  p.date = EnvOr("TESSERA_BENCH_DATE",
                 absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()));
  p.machine = EnvOr("TESSERA_BENCH_MACHINE", DescribeMachine());
  return p;
}

std::string ResultsDir(const std::string& fallback) {
  return EnvOr("TESSERA_BENCH_RESULTS", fallback);
}

std::string ResultsBesideExecutable() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return "results";
  return (self.parent_path() / "results").string();
}

absl::Status WriteResultsFile(const std::string& dir, const std::string& file_name,
                              const std::string& text) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", error.message()));
  const std::string path = absl::StrCat(dir, "/", file_name);
  std::ofstream out(path);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat(path, ": cannot write"));
  std::cout << "wrote " << path << "\n";
  return absl::OkStatus();
}

}  // namespace tessera::bench
