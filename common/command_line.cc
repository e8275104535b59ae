#include "common/command_line.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "common/version.h"

namespace tessera {
namespace {

// Abseil's own --help exits with status 1 and lists flags by source file;
// ours prints the usage and the binary's own flags, and exits 0.
void PrintHelp(const char* usage) {
  std::cout << usage << "\nFlags:\n";
  std::vector<std::pair<std::string, const absl::CommandLineFlag*>> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "absl/")) continue;
    flags.emplace_back(std::string(name), flag);
  }
  std::sort(flags.begin(), flags.end());
  for (const auto& [name, flag] : flags) {
    std::cout << "  --" << name << "  (default: \"" << flag->DefaultValue() << "\")\n      "
              << flag->Help() << "\n";
  }
  std::cout << "  --help, --version, --helpfull (every flag, Abseil's included)\n";
}

}  // namespace

void AcceptDashedFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg.substr(0, 2) != "--") continue;
    for (char* c = argv[i] + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const char* usage) {
  AcceptDashedFlags(argc, argv);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-help" || arg == "-h") {
      PrintHelp(usage);
      std::exit(0);
    }
  }
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.version_string = [] { return BuildSummary() + "\n"; };
  absl::SetFlagsUsageConfig(config);
  return absl::ParseCommandLine(argc, argv);
}

}  // namespace tessera
