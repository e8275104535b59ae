// Small number formats shared by the CLI's text output.
#pragma once

#include <string>

#include "absl/strings/str_format.h"

namespace tessera::client {

// A rate with a k/M suffix: 950, 12.3k, 1.25M.
inline std::string FormatRate(double value) {
  if (value >= 1e6) return absl::StrFormat("%.2fM", value / 1e6);
  if (value >= 1e3) return absl::StrFormat("%.1fk", value / 1e3);
  return absl::StrFormat("%.0f", value);
}

}  // namespace tessera::client
