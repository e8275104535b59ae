// The one mapping from an errno value to an absl::Status with the canonical
// code that fits (missing file NOT_FOUND, full disk RESOURCE_EXHAUSTED, ...).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tessera {

// "<what>: <strerror(error)>" with the code that fits `error`.
absl::Status ErrnoToStatus(int error, absl::string_view what);

}  // namespace tessera
