// How a fuzz target reports a broken contract (a result its header rules out) rather than a
// crash: a message, then abort(), which libFuzzer records as a crash with its input.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"

namespace tessera::fuzz {

[[noreturn]] inline void ContractBroken(absl::string_view what) {
  std::fprintf(stderr, "contract broken: %s\n", std::string(what).c_str());
  std::abort();
}

}  // namespace tessera::fuzz
